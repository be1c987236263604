"""The method API, everything a method is written against: what it may read and write of its layer (contract.py),
the policy protocol, its parameters and the budget (policy.py), the selection base of eviction methods
(selection.py), the attention math (attention_math.py), the stores (kvstore.py, full_cache.py, quantized_store.py)
and RoPE (rope.py). docs/adding-a-method.md walks through them. Behind the math and the stores, not for methods to
read: their C kernels (selection_kernels.c, built and loaded by native_library.py, called from native_selection.py,
native_attention.py and native_quantized.py). The engine that runs a method inside a model is refreshkv/engine/,
which a method never imports."""
