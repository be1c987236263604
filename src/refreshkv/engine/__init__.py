"""The engine that runs a method inside a transformers model: the `PolicyCache` that hands each layer to its method
(cache.py; its statistics, decode_stats.py), the attention function registered with transformers (attention.py) and
the handoff of each layer to it (handoff.py), one prefill shared by several methods (shared_prefill.py), row groups
joined into one batch (join_rows.py), sliding-window layers (sliding_window.py), word spans (spans.py) and the cache
keyword (cache_argument.py). A method never imports it: what a method is written against is in refreshkv/core/
(docs/adding-a-method.md)."""
