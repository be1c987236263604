"""The attention backend the plugin puts in place of vLLM's CPU_ATTN: vLLM's own, plus the method on decoded tokens.

Each step the metadata builder sorts the batch's rows (batch_rows.py says which request each is): prefill chunks
and the requests the method does not act on go to vLLM's own kernel, as one sub-batch; each served request's
decoded token goes through its method's `decode` (request_layer.py), which reads C_p, or C_f from vLLM's blocks
at a full step. Requests at different positions and on their own schedules share a step: some refresh while others
take partial steps, and prefill chunks run beside them. Sliding-window layers (Gemma 3's local ones) stay vLLM's.
Without the "refreshkv" key in `--additional-config` every row goes to vLLM's kernel, as without the plugin.

The same structure suits FlashAttention on CUDA (a builder that splits the rows, an implementation that runs the
engine's kernel on its sub-batch): only `paged_blocks`, the engine's block layout, differs. It is not built here.
"""

from __future__ import annotations

import dataclasses
import functools

import psutil
import torch
from torch import Tensor
from vllm import _custom_ops as ops
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from ..core.native_library import on_cpu
from ..core.policy import Policy, PolicyError
from .batch_rows import ROWS
from .held_steps import HeldSteps
from .paged_store import PagedBlocks, cpu_blocks
from .plugin_config import worst_case_bytes
from .request_layer import Request
from .vllm_rows import LOG, UNSERVED, engine_policy
from .window_store import WINDOWS


@dataclasses.dataclass
class ServePlan:
    """How a step's rows are served: vLLM's kernel on `engine` (None: no row is vLLM's) over the step's tokens at
    `engine_tokens` (None: all of them), the method on each of `decodes` (token index, request, sequence length,
    block ids), and of each prefill chunk in `prefills` (request, first token, end, sequence length, block ids) the
    last queries kept; the chunk that ends a prompt stores it in the method (C_p selected there)."""

    engine: CPUAttentionMetadata | None
    engine_tokens: Tensor | None
    decodes: list[tuple[int, Request, int, Tensor]]
    prefills: list[tuple[Request, int, int, int, Tensor]]


@dataclasses.dataclass
class PlannedMetadata(CPUAttentionMetadata):
    plan: ServePlan | None = None


class RefreshKVMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config: VllmConfig, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        policy = engine_policy(vllm_config)
        self.active = self.window_size == -1  # a request may bring its own method without the engine's
        if self.active and device.type == "cpu":
            on_cpu()  # the C built now (about 2 s), not inside the first request's prefill step
        if self.active and policy is not None:  # built once vLLM holds its KV space: the plugin's must fit beside it
            slot_bytes = kv_cache_spec.page_size_bytes // kv_cache_spec.block_size + 12 * kv_cache_spec.num_kv_heads
            scheduler = vllm_config.scheduler_config
            check_memory(
                policy, vllm_config.model_config.max_model_len, scheduler.max_num_seqs, len(layer_names), slot_bytes
            )

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> CPUAttentionMetadata:
        whole = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if not self.active or not ROWS.rows:
            return whole
        batch = common_attn_metadata
        starts = batch.query_start_loc_cpu.tolist()
        lengths = batch.seq_lens.cpu().tolist()
        engine_rows, decodes, prefills = [], [], []
        for row in range(batch.num_reqs):
            request, start, end, seq_len = ROWS.rows.get(row), starts[row], starts[row + 1], lengths[row]
            if request is None or end == start:  # vLLM's alone: no block table to slice
                engine_rows.append((row, start, end, seq_len))
                continue
            # as the C reads block tables: converted once here, not at each layer
            block_ids = batch.block_table_tensor[row, : -(-seq_len // self.block_size)].to(torch.int64)
            if request.is_decoding(seq_len, end - start):
                decodes.append((end - 1, request, seq_len, block_ids))
                if end - 1 > start:  # a resumed request's recomputed tokens: vLLM's, before its last
                    engine_rows.append((row, start, end - 1, seq_len - 1))
                continue
            engine_rows.append((row, start, end, seq_len))
            if not request.layers:  # its prompt, not yet stored
                prefills.append((request, start, end, seq_len, block_ids))
        planned = PlannedMetadata(**{f.name: getattr(whole, f.name) for f in dataclasses.fields(whole)})
        if not decodes:
            planned.plan = ServePlan(whole, None, [], prefills)
            return planned
        engine, tokens = self._engine_rows(batch, engine_rows)
        planned.plan = ServePlan(engine, tokens, decodes, prefills)
        return planned

    def _engine_rows(
        self, batch: CommonAttentionMetadata, rows: list[tuple[int, int, int, int]]
    ) -> tuple[CPUAttentionMetadata | None, Tensor | None]:
        """vLLM's metadata over `rows` alone (row, first token, end, sequence length), and their tokens' indices in
        the step."""
        if not rows:
            return None, None
        tokens = torch.cat([torch.arange(start, end) for _, start, end, _ in rows])
        counts = torch.tensor([end - start for _, start, end, _ in rows])
        query_start = torch.zeros(len(rows) + 1, dtype=batch.query_start_loc.dtype)
        query_start[1:] = counts.cumsum(0)
        index = torch.tensor([row for row, _, _, _ in rows])
        seq_lens = torch.tensor([seq_len for _, _, _, seq_len in rows], dtype=batch.seq_lens.dtype)
        sub = CommonAttentionMetadata(
            query_start_loc=query_start,
            query_start_loc_cpu=query_start,
            seq_lens=seq_lens,
            num_reqs=len(rows),
            num_actual_tokens=len(tokens),
            max_query_len=int(counts.max()),
            max_seq_len=int(seq_lens.max()),
            block_table_tensor=batch.block_table_tensor.index_select(0, index),
            slot_mapping=batch.slot_mapping.index_select(0, tokens),
            causal=batch.causal,
        )
        return super().build(0, sub), tokens


class RefreshKVImpl(CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # found at this layer's first step and kept (found anew, the two cost about 40 us per layer and step)
        self.layer_idx: int | None = None
        self.blocks: tuple[Tensor, PagedBlocks] | None = None  # the engine's cache tensor and its blocks
        if self.attn_type == AttentionType.DECODER and self.sliding_window == -1:
            unhandled = {
                "a logit soft cap": bool(self.logits_soft_cap),
                "ALiBi": self.alibi_slopes is not None,
                "attention sinks": self.sinks is not None,
                "a quantized KV cache": self.is_fp8_kv_cache,
            }
            named = [name for name, present in unhandled.items() if present]
            if named:
                UNSERVED.reason = f"the refreshkv plugin does not handle attention with {', '.join(named)}"
                if engine_policy(get_current_vllm_config()) is not None:
                    raise PolicyError(f"{UNSERVED.reason}; run this model without the 'refreshkv' key")

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs) -> Tensor:
        plan = getattr(attn_metadata, "plan", None)
        if plan is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        if self.layer_idx is None:
            self.layer_idx = extract_layer_index(layer.layer_name)
        layer_idx = self.layer_idx
        for request, start, end, seq_len, _ in plan.prefills:  # the question's window
            request.keep_window(layer_idx, query[start:end].transpose(0, 1).unsqueeze(0), seq_len - (end - start))
        if plan.engine is not None and plan.engine_tokens is None:
            super().forward(layer, query, key, value, kv_cache, plan.engine, output)
        elif plan.engine is not None:
            tokens = plan.engine_tokens
            theirs = output.new_empty((len(tokens), *output.shape[1:]))
            super().forward(layer, query.index_select(0, tokens), key, value, kv_cache, plan.engine, theirs)
            output.index_copy_(0, tokens, theirs)
        ended = [(request, ids) for request, _, _, seq_len, ids in plan.prefills if seq_len == request.prefilled]
        if ended or plan.decodes:
            if self.blocks is None or self.blocks[0] is not kv_cache:  # the engine hands the same tensor each step
                self.blocks = (kv_cache, paged_blocks(kv_cache, layer.isa))
            blocks = self.blocks[1]
        for request, block_ids in ended:  # the prompt's keys are all in the blocks now
            request.store_prompt(layer_idx, blocks, block_ids, self.scale)
        if plan.decodes:
            self._decode(layer_idx, plan.decodes, query, key, value, blocks, output)
        return output

    def _decode(self, layer_idx, decodes, query, key, value, blocks, output) -> None:  # type: ignore[no-untyped-def]
        """Each served request's decode step in turn; their partial steps' attention at the end, in one call, into
        the step's output rows (held_steps.py)."""
        rows = output.view(len(output), *query.shape[1:])  # (tokens, Hq, D)
        held = HeldSteps(rows)
        tokens = torch.tensor([token for token, _, _, _ in decodes])
        # each decoded token's query, key and value as (1, heads, 1, D), taken out of the step's rows at once
        taken = (
            x.index_select(0, tokens).view(len(decodes), 1, -1, 1, x.shape[-1]).unbind(0) for x in (query, key, value)
        )
        for (token, request, seq_len, block_ids), q, k, v in zip(decodes, *taken):
            request.restore_answer(layer_idx, blocks, block_ids)  # after a preemption's recomputation
            held.row, before = token, len(held)
            attended = request.decode(layer_idx, q, k, v, self.scale, blocks, block_ids, seq_len, held)
            if len(held) == before:  # not held: its own output
                rows[token] = attended.reshape(rows.shape[1:])
        held.attend(self.scale)


def check_memory(policy: Policy, max_model_len: int, max_num_seqs: int, layers: int, slot_bytes: int) -> None:
    """State the plugin's worst case at start (`worst_case_bytes`, with the window store) and refuse (PolicyError)
    an engine whose worst case does not fit in the memory left beside vLLM's KV space."""
    worst = worst_case_bytes(policy, max_model_len, max_num_seqs, layers, slot_bytes) + WINDOWS.capacity
    available = psutil.virtual_memory().available
    LOG.info(
        "refreshkv plugin: at most %.2f GiB of partial caches and question windows (%d requests of up to %d tokens, "
        "%.2f GiB free beside vLLM's KV space)",
        worst / 2**30,
        max_num_seqs,
        max_model_len,
        available / 2**30,
    )
    if worst > available:
        raise PolicyError(
            f"the refreshkv plugin may hold {worst / 2**30:.1f} GiB ({max_num_seqs} requests of up to {max_model_len} "
            f"tokens), more than the {available / 2**30:.1f} GiB free beside vLLM's KV space: lower --max-num-seqs, "
            "--max-model-len or the budget, or give vLLM less KV space (VLLM_CPU_KVCACHE_SPACE)"
        )


def paged_blocks(kv_cache: Tensor, isa: str) -> PagedBlocks:
    """One layer's vLLM CPU cache, its layout checked once (`checked_layout`)."""
    checked_layout(isa, kv_cache.dtype, kv_cache.shape[2], kv_cache.shape[3] // 2)
    return cpu_blocks(kv_cache)


@functools.cache
def checked_layout(isa: str, dtype: torch.dtype, block_size: int, head_dim: int) -> None:
    """Refuse (PolicyError) a layout `cpu_blocks` does not read: tokens written by vLLM's own cache kernel must come
    back as written. Checked once per kind of cache."""
    heads = 2
    written = torch.randn(3, heads, head_dim).to(dtype), torch.randn(3, heads, head_dim).to(dtype)
    cache = torch.zeros(2, heads, block_size, 2 * head_dim, dtype=dtype)
    halves = cache.view(2, heads, 2 * block_size, head_dim).chunk(2, dim=2)
    slots = torch.tensor([0, 1, block_size + 2])
    ops.cpu_attn_reshape_and_cache(*written, *halves, slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    read = cpu_blocks(cache).gather(torch.tensor([0, 1]), 0, block_size + 3)
    for read_back, wrote in zip(read, written):
        if not torch.equal(read_back[0][:, slots].transpose(0, 1), wrote):
            raise PolicyError(
                f"vLLM's CPU attention lays out its {dtype} cache for ISA '{isa}' in a way the refreshkv plugin does "
                "not read; run with --dtype float32"
            )


class RefreshKVBackend(CPUAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"  # vLLM's own name: the engine treats it as its CPU backend

    @staticmethod
    def get_impl_cls() -> type[RefreshKVImpl]:
        return RefreshKVImpl

    @staticmethod
    def get_builder_cls() -> type[RefreshKVMetadataBuilder]:
        return RefreshKVMetadataBuilder
