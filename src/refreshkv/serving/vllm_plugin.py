"""The vLLM plugin's entry point (`vllm.general_plugins`, pyproject.toml): vLLM calls `register` in each of its
processes. On the CPU platform vLLM takes CPU_ATTN's class path whatever `--attention-backend` says, so the plugin
registers its backend (vllm_backend.py) under that name; without the "refreshkv" key in `--additional-config` it is
vLLM's own. The batch's rows reach the plugin through its logits processor (vllm_rows.py, `vllm.logits_processors`).
"""


def register() -> None:
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_ATTN, "refreshkv.serving.vllm_backend.RefreshKVBackend")
