"""Every upstream defect or limit flexspec works around, in one table: which library and
version showed it, what went wrong, what flexspec does about it, and the test that shows it (or
pins the workaround). Code that applies one cites it in a one-line comment or message as
``flexspec.workarounds: NAME``; nothing else in the package names a GPU or a library version.

When a new torch, Triton, FA4 or transformers arrives, this is the list to re-check: an entry
whose symptom no longer reproduces can go, with the code that cites it. The measurements behind
the entries are in docs/performance.md (why the backend rules are what they are).

>>> WORKAROUNDS["cpu-short-sequences"].library
'torch'
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Workaround:
    """One upstream defect or limit (see the module docstring)."""

    name: str
    library: str     # who has the defect
    seen: str        # the versions and hardware it was seen with
    symptom: str
    remedy: str      # what flexspec does about it
    test: str        # the test that shows it, or pins the workaround (path::name)


_TABLE = (
    Workaround(
        "cpu-short-sequences", "torch", "torch 2.13.0+cpu, compiled FlexAttention",
        "wrong results (NaN, or differing run to run) for sequences of 8 to 120 positions, "
        "shorter than one 128-position block; plain torch reproduces it, 127, 129 and longer "
        "sequences were right",
        "the flex backend refuses CPU calls with Q_LEN or KV_LEN under 128; SDPA or the dense "
        "reference runs them",
        "tests/runtime/test_runtime.py::test_short_cpu_sequences_run_on_the_reference"),
    Workaround(
        "cpu-flex-lse", "torch", "torch 2.13.0+cpu, compiled FlexAttention",
        "flex_attention(..., return_aux=AuxRequest(lse=True)) raises 'return_lse is not "
        "supported yet' on the CPU",
        "the flex backend refuses return_lse=True on the CPU; auto runs such calls on the dense "
        "reference (gpt-oss's sinks merge through the log-sum-exp)",
        "tests/runtime/test_backends.py::test_return_lse_on_the_cpu_runs_on_the_reference"),
    Workaround(
        "cpu-mask-free-block-mask", "torch", "torch 2.13.0+cpu, compiled FlexAttention",
        "block_mask=None with a score_mod gave wrong results (NaN, or differing run to run)",
        "a spec without a mask gets an all-full block mask on every device but CUDA",
        "tests/runtime/test_plan.py::test_a_mask_free_spec_keeps_a_block_mask_off_cuda"),
    Workaround(
        "flex-decoding-one-block", "torch", "torch 2.11.0+cu130, Triton 3.6, H200",
        "flex_attention without a block mask makes one block of the whole cache, so its "
        "decoding kernel's split-KV gives all the keys to one split: a decoded token under "
        "`causal + softcap(30)` (32K cache, B=8) took 1.47 ms of kernel against 0.42 ms with a "
        "block mask of 128-key blocks",
        "a mask-free spec keeps an all-full block mask on CUDA when it has fewer than 128 query "
        "rows",
        "tests/runtime/test_plan.py::test_a_mask_free_spec_keeps_a_block_mask_off_cuda"),
    Workaround(
        "triton-table-grad-stages", "torch", "torch 2.11.0+cu130, Triton 3.6, H200",
        "the Triton backward of a score that reads a tensor requiring gradients ran out of "
        "shared memory at D=128",
        "such calls run with num_stages=1 on CUDA at head dimensions above 64",
        "tests/runtime/test_backends.py::test_triton_tiles_divide_the_blocks"),
    Workaround(
        "triton-backward-small-blocks", "torch", "torch 2.11.0+cu130, Triton 3.6, H200",
        "the Triton backward found no kernel for blocks smaller than 128: torch drops the tile "
        "configurations that do not divide the blocks before it reads kernel options",
        "the flex backend refuses CUDA backward passes with blocks that are not multiples of "
        "128, and says to use block_size=128 for training",
        "tests/runtime/test_backends.py::test_triton_backward_needs_blocks_of_128_on_cuda"),
    Workaround(
        "gpu-int32-indices", "torch", "torch 2.11.0+cu130, FlexAttention's Triton and FLASH "
        "kernels, H200",
        "b, h, q_idx, kv_idx and integer arithmetic on them are int32: "
        "q * 16777216 >= kv * 16777216 wrapped from q = 128 on (output off by 0.75)",
        "integer expressions are checked against int32's range on CUDA before anything runs",
        "tests/ir/test_overflow.py::test_gpu_kernels_compute_in_int32"),
    Workaround(
        "flash-gqa-score-backward", "FA4 (flash_attn.cute)", "flash-attn-4 4.0.0b36, torch "
        "2.11, H200",
        "FLASH's backward gave wrong gradients for a score that reads a tensor under "
        "grouped-query attention (ALiBi, 4 query heads over 2 KV heads: relative errors 1.7 to "
        "72, or NaN); right ones without GQA",
        "the flash backend refuses such backward passes",
        "tests/runtime/test_backends.py::"
        "test_flash_backward_is_not_used_for_scores_that_read_tensors_under_gqa"),
    Workaround(
        "flash-constant-index", "CuTeDSL (FA4)", "flash-attn-4 4.0.0b36, torch 2.11",
        "a tensor read at a constant index failed to compile: 'Expected TensorSSA, but got "
        "int'",
        "the flash backend refuses such lookups (a binding with a broadcast batch or head "
        "dimension); int q_offsets and a given scale are stored one entry per batch row and "
        "read at b",
        "tests/runtime/test_backends.py::test_flash_refuses_lookups_at_a_constant_index"),
    Workaround(
        "flash-nested-lookup", "CuTeDSL (FA4)", "flash-attn-4 4.0.0b36, torch 2.11",
        "a lookup whose index reads another tensor (doc_ids[b, q + q_offset[b]]) failed: "
        "'Type mismatch, store Int64 to Tensor with element type Int32'",
        "the flash backend refuses such lookups",
        "tests/ir/test_forms.py::"
        "test_lookups_at_a_constant_index_and_lookups_inside_indices_are_found"),
    Workaround(
        "flash-lse", "FA4 (flash_attn.cute)", "flash-attn-4 4.0.0b36, torch 2.11, H200",
        "FLASH's log-sum-exp disagreed with the reference (causal & window(200) + alibi at "
        "q_offset=5)",
        "the flash backend refuses return_lse=True; fa4 and flex, which agreed, run it",
        "tests/test_gpu.py::test_lse_matches_the_reference"),
    Workaround(
        "flash-head-dims", "FA4 (flash_attn.cute)", "flash-attn-4 4.0.0b36, torch 2.11, H200",
        "head dimension 256 failed with flexspec's block sizes ('sparse_block_size[1] must be a "
        "multiple of tile_n=80'); 64 and 128 ran correctly",
        "both FA4 backends take head dimensions 64 and 128 only",
        "tests/test_gpu.py::test_flash_runs_head_dim_64"),
    Workaround(
        "cute-maximum", "CuTeDSL (FA4)", "flash-attn-4 4.0.0b36, torch 2.11's code generator",
        "torch.maximum and torch.minimum were rejected ('UNSUPPORTED CUTEDSL OPERATION')",
        "the cute dialect of the lowering writes min, max, clamp and abs of tensors with "
        "torch.where over comparisons",
        "tests/kernels/test_lower.py::test_the_cute_form_has_no_minimum_maximum_clamp_abs_or_sign"),
    Workaround(
        "cute-floor-ceil", "torch", "torch 2.11's CuTeDSL code generator (2.13's has them)",
        "floor and ceil have no CuTeDSL form",
        "the cute dialect converts to int32 and corrects by one where the conversion truncated "
        "the wrong way",
        "tests/kernels/test_lower.py::test_the_cute_floor_and_ceil_round_like_the_reference"),
    Workaround(
        "cute-where-of-scalars", "CuTeDSL (FA4)", "flash-attn-4 4.0.0b36, torch 2.11, H200",
        "torch.where of two Python scalars gave wrong values (relative error 0.63 for "
        "score + where(kv > q, 4, 0)), a where with a tensor branch right ones",
        "the cute dialect writes it as cond * a + (1 - cond) * b with the condition converted, "
        "or a where whose second branch is made a tensor where a branch is infinite",
        "tests/test_gpu.py::test_flash_chooses_between_scalars_like_the_reference"),
    Workaround(
        "cute-int-division", "CuTeDSL", "CuTeDSL 4.8.1 (read in TensorSSA._apply_op)",
        "a division of two int32 vectors is computed in float32 but labelled Int32, so later "
        "conversions could misread it",
        "the cute dialect makes the tensor operand of / of two ints a float",
        "tests/kernels/test_lower.py::test_lowering_cute_fixture"),
    Workaround(
        "dynamo-bool-equality", "torch", "torch 2.13 (dynamo and inductor)",
        "== and != of a symbolic bool (a comparison of a length marked dynamic) with a bool "
        "failed: 'BooleanAtom not allowed in this context'",
        "the lowering compares the scalar side of such a comparison as an int",
        "tests/runtime/test_runtime.py::"
        "test_masks_comparing_constants_with_the_lengths_run_at_new_lengths"),
    Workaround(
        "dynamo-nan-comparison", "torch", "torch 2.13 (dynamo)",
        "a NaN constant compared with a symbolic length failed: 'Invalid NaN comparison'",
        "the simplifier folds a comparison with a NaN of constants to its IEEE value",
        "tests/runtime/test_runtime.py::"
        "test_masks_comparing_constants_with_the_lengths_run_at_new_lengths"),
    Workaround(
        "dynamo-recompile-fallback", "torch", "torch 2.11 and 2.13 (dynamo)",
        "at its recompile limit dynamo falls back, silently, to an unfused path that "
        "materialises the scores (out of memory at long lengths)",
        "calls that may compile run with fail_on_recompile_limit_hit and raise "
        "CompileLimitError; lengths are marked dynamic from the second compile on",
        "tests/runtime/test_runtime.py::test_reaching_the_recompile_limit_is_a_flexspec_error"),
    Workaround(
        "inductor-strided-capture", "torch", "torch 2.13 (inductor)",
        "a kernel that captures a strided view (doc_ids=ids[::2]) failed to compile",
        "bindings are made contiguous before a kernel reads them",
        "tests/runtime/test_runtime.py::test_strided_bindings_run"),
    Workaround(
        "cudnn-decode-plans", "torch (cuDNN SDPA)", "torch 2.11.0+cu130, H200",
        "cuDNN builds a new plan for every new key length: about 60 ms per step of a growing "
        "cache",
        "SDPA calls of at most 16 query rows (decoding) run without cuDNN, over runs of batch "
        "rows of 128 (batch row, KV head) pairs (FlashAttention's SDPA over more ran up to "
        "1.8x slower)",
        "tests/runtime/test_backends.py::test_sdpa_decoding_steps_leave_cudnn_out"),
    Workaround(
        "compiled-call-new-generation", "torch (dynamo, CUDA graph trees)",
        "torch 2.11.0+cu130, H200, transformers 5.17 (static cache, forward compiled with "
        "mode='reduce-overhead')",
        "every call of a torch.compile'd function from eager code starts a new generation of "
        "CUDA graph trees: flexspec's kernel, called between a compiled model's graphs, made "
        "the next graph overwrite the previous graph's outputs it still read ('accessing tensor "
        "output of CUDAGraphs that has been overwritten by a subsequent run')",
        "flexspec's compiled entry points and block-mask programs are called with dynamo's "
        "generation left as it was (flexspec.kernels.generations)",
        "tests/runtime/test_runtime.py::test_flexspec_s_compiled_calls_leave_cuda_graph_"
        "generations_alone"),
    Workaround(
        "flex-decoding-dynamic-batch", "torch (inductor)", "torch 2.11.0+cu130 and 2.13",
        "FlexAttention runs its decoding kernel only for a static batch and head count; dynamo "
        "makes the batch dynamic once it has seen a second batch size, and every later call of "
        "fewer than 128 rows then ran on the main kernel",
        "calls on the decoding kernel mark their batch and head dimensions static, where "
        "their strides follow from the inner sizes (dynamo keeps the stride of a dimension "
        "marked static a constant, guarded exactly: keys read through a window of a cache "
        "grown by concatenation compiled at every step; runtime.compiled.mark_batch_static)",
        "tests/test_gpu.py::test_decode_calls_run_on_the_decoding_kernel_at_every_batch_size"),
    Workaround(
        "flex-decoding-wide-indices", "torch (inductor)", "torch 2.11.0+cu130, H200",
        "FlexAttention's decoding kernel does not compile where the keys or values hold 2**31 "
        "elements or more (B=64, 8 key heads, 32K keys, D=128): its int32 block counts meet "
        "int64 indices ('Ternary expression with dynamic condition has inconsistent types "
        "int64 and int32'), with int64 counts too; hand-written FlexAttention fails alike",
        "such calls run on FlexAttention's main kernel (FORCE_USE_FLEX_ATTENTION), several "
        "times slower than the decoding kernel; a plain decode call runs as a call per run of "
        "batch rows whose keys are narrower (Attention.__call__), and a paged read of such a "
        "pool as one per group of KV heads (runtime/flexpages), each on the decoding kernel",
        "tests/runtime/test_plan.py::test_calls_of_few_rows_on_cuda_run_on_the_decoding_kernel"),
    Workaround(
        "flex-decoding-full-blocks", "torch (inductor)", "torch 2.11.0+cu130 and 2.13",
        "with full blocks in the block mask, the decoding kernel splits all of KV_LEN among its "
        "splits, not the row's listed blocks: a window at the end of a long cache was read by "
        "one split while the others idled (a decoding block mask never has full blocks: its "
        "query block runs past Q_LEN, but the kernel reads an empty full table as full blocks)",
        "calls on the decoding kernel get block masks without full tables, every tile listed "
        "as partial (flexspec.kernels.block_tables.as_partial)",
        "tests/kernels/test_blocks.py::test_as_partial_lists_every_tile_as_partial_in_order"),
    Workaround(
        "dynamic-stride-alignment", "torch (dynamo, inductor)", "torch 2.11.0+cu130, H200",
        "once a length is dynamic, a stride that does not follow from the sizes (keys viewed "
        "in a longer cache, cache[:, :, :n]) becomes a symbol of its own, which inductor cannot "
        "prove a multiple of 16; the decoding kernel then loads unaligned: 0.76 ms against "
        "0.24 ms at 32K keys, B=8. A guard that the stride is a multiple of 16 did not help on "
        "torch 2.11 (it does on 2.13)",
        "the compiled entry states such a stride as 16 times a number "
        "(runtime.compiled.free_strides): a constant for one cache, a multiple of 16 once the "
        "number changes (a cache grown by concatenation, read through a window)",
        "tests/runtime/test_compiles.py::test_a_cache_view_s_strides_stay_constants_when_"
        "lengths_turn_dynamic"),
    Workaround(
        "inductor-symbol-order", "torch (inductor)", "torch 2.11.0+cu130, H100; 2.13.0+cpu",
        "a graph input whose size or stride is a product with a symbol (keys' strides "
        "32*s0, 16*s0) must come after an input that is that symbol alone; else inductor "
        "refuses the graph ('For 32*s0, expected [s0] to have been codegen-ed'). It happened "
        "when one spec read keys viewed in caches of two capacities: the pinned stride's "
        "number turned dynamic, and dynamo placed it after the keys",
        "the compiled entry reads the pinned strides' numbers before it reads q, k and v "
        "(runtime.compiled.compiled_entry)",
        "tests/runtime/test_compiles.py::test_keys_viewed_in_caches_of_two_capacities_"
        "compile_with_inductor"),
    Workaround(
        "cpu-dynamic-row-binding", "torch", "torch 2.13.0+cpu, compiled FlexAttention",
        "once lengths are dynamic, the C++ kernel of a mask that reads a binding with a row per "
        "batch row (causal & key_padding's valid[B, KV_LEN], B >= 2) does not compile "
        "('cur_qSplitSize1' was not declared in this scope); nor does a paged read in place "
        "(its mask reads the page table by batch row) once its batch or query length is "
        "dynamic ('cur_kvSplitSize3')",
        "a compile torch gives up on under auto moves the spec's calls to the next backend that "
        "can run them, with a warning (backends.flex.FlexBackend.compile_failed); paged reads "
        "in place on the CPU compile with static shapes, once per shape (runtime.flexpages."
        "PagedCall.static)",
        "tests/runtime/test_compiles.py::test_a_mask_reading_rows_of_keys_compiles_for_new_"
        "lengths_on_the_cpu_or_runs_elsewhere"),
    Workaround(
        "cudagraph-trees-warm-up-pool", "torch (inductor)", "torch 2.11.0+cu130, H200",
        "torch.compile's CUDA graph trees (mode=\"reduce-overhead\") run each graph once before "
        "recording it, allocating from the graph's memory pool without a capture, and then "
        "refuse the graph ('Detected N tensor(s) in the cudagraph pool not tracked as "
        "outputs') when a tensor of that pool outlives the run: flexspec's plans and block "
        "masks made there (a plan's scale, a block mask's eight index tables) and the caches "
        "keyed by the run's tensors",
        "during the warm-up the transformers operator allocates outside the pool "
        "(runtime.capture.outside_graph_pool), and nothing is kept by or looked up by the "
        "run's tensors, as inside a capture (runtime.capture.in_graph_memory)",
        "tests/runtime/test_capture.py::test_outside_graph_pool_leaves_the_warm_up_s_pool_and_"
        "comes_back"),
    Workaround(
        "cudagraph-trees-dispatch-state", "torch (inductor)", "torch 2.11.0+cu130, H200",
        "CUDA graph trees warm a graph up and record it in different dispatch states (one in "
        "inference mode, the other below the custom operator's autograd kernel), with inference "
        "tensors in one and ordinary ones in the other; dynamo guards on the dispatch keys a "
        "tensor shows, so a kernel compiled in the warm-up compiled again during the recording, "
        "which fails there ('operation not permitted when stream is capturing')",
        "the transformers operator always runs in inference mode with ADInplaceOrView excluded "
        "(ordinary and inference tensors then show the same keys), copies its small tensors to "
        "ordinary ones, and returns an ordinary tensor",
        "tests/integrations/test_transformers.py::test_inside_the_operator_ordinary_and_"
        "inference_tensors_show_the_same_keys"),
)

WORKAROUNDS: dict[str, Workaround] = {entry.name: entry for entry in _TABLE}
