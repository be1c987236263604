"""The methods inside a serving engine: a vLLM plugin (vllm_plugin.py) that runs the methods which keep the full
cache over vLLM's own paged blocks, with the same code as the transformers path (the method's hooks on a
`RequestLayer`, request_layer.py, over a `PagedFullStore`, paged_store.py)."""
