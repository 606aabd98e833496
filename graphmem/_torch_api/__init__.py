"""The only user of torch's private APIs (and of the few private names of libraries built on
it that graphmem needs: bitsandbytes'), in one package.  Version checks live here.

Every private name graphmem relies on is imported or read once, in these modules, so that a
torch upgrade that moves one breaks in one place with one clear message; graphmem's other
modules import the names from ``graphmem._torch_api`` and call its named accessors (a module's
own tables, an op's schema, a storage's id, the internals of FSDP and pipelining) instead of
reading torch's underscore attributes themselves (ruff's SLF001 checks it).  The modules, by
topic:

- ``fakes``: fake tensors, FakeTensorMode, and where torch must take a fake for a plain tensor.
- ``symbolic``: size symbols (ShapeEnv), their values and guards.
- ``tensors``: a tensor's storage id and liveness, version counter, view and sparse parts.
- ``autograd``: the engine's current node, sequence numbers, backward without the
  torch-function hop.
- ``dispatch``: op schemas, kernels per dispatch key, dispatch modes, FLOP formulas, checks.
- ``modules``: an nn.Module's own tables of parameters, buffers and children, ``_apply``.
- ``distributed``: the fake process group, FSDP2, the first FSDP, DTensor, device meshes.
- ``pipelining``: torch.distributed.pipelining's stages and schedules.
- ``compiled``: inductor's compile, its generated wrapper replayed on fake tensors.
- ``runtime``: data loaders, generators, accelerator hooks, per-device caches.
"""

from __future__ import annotations

from graphmem._torch_api._version import MIN_TORCH
from graphmem._torch_api.autograd import (
    autograd_sequence_nr,
    backward_keeping_modes,
    backward_without_hop,
    current_autograd_node,
    node_sequence_nr,
)
from graphmem._torch_api.compiled import (
    compile_with_inductor,
    compiles_a_module_call,
    global_hooks_off,
    inductor_cache_dir,
    mode_options,
    replay_on_fakes,
)
from graphmem._torch_api.dispatch import (
    TENSOR_CHECK,
    HigherOrderOperator,
    OpOverload,
    TorchDispatchMode,
    check_with,
    count_flops,
    destroy_library,
    dispatch_key_guard,
    dispatch_modes_pushed,
    is_cached_tensor,
    op_schema,
    ops_with_kernel_for,
    outside_modes,
    sdp_priority_order,
    tensor_check,
    tree_flatten,
    tree_map,
)
from graphmem._torch_api.distributed import (
    dtensor_sharding_fakes_on,
    fake_process_group_store,
    fsdp1_handle,
    fsdp1_local_shard,
    fsdp1_reshard,
    fsdp1_runtime,
    fsdp1_sharded_views_skipped,
    fsdp_lazy_init,
    fsdp_storage_modules,
    local_tensor,
    meshes_made_for_real,
    process_group_sizes,
    strided_shards_indexed_for_real,
)
from graphmem._torch_api.fakes import (
    DATA_DEPENDENT_ERRORS,
    OP_ERRORS,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
    fake_like,
    fake_mode_without_cuda,
    fakes_shown_on,
    fakes_take_foreach_paths,
    holds_fakes,
    is_fake,
    quiet_fake_tensor_logs,
    to_fake,
    unset_fake_temporarily,
)
from graphmem._torch_api.modules import (
    MODULE_APPLY,
    module_apply,
    module_buffers,
    module_children,
    module_non_persistent_buffers,
    module_parameters,
    quantized_on_meta,
    set_module_children,
    unpatched_module_apply,
)
from graphmem._torch_api.pipelining import (
    pipeline_backward_meta,
    pipeline_inference_mode,
    pipeline_warmup_owners,
    schedule_stage,
    set_stage_inference_mode,
    stage_peer_rank,
    stage_same_rank,
    stage_user_meta,
)
from graphmem._torch_api.runtime import (
    accelerator_hooks,
    data_loading_in_process,
    generator_started_at,
    per_device_caches_cleared,
)
from graphmem._torch_api.symbolic import (
    MAX_SYMBOLIC_SIZE,
    SYMBOLIC_REFERENCES,
    ShapeEnv,
    expr_of,
    hint_of,
    shape_guards,
    size_symbol,
)
from graphmem._torch_api.tensors import (
    StorageWeakRef,
    all_true,
    coo_parts,
    is_view,
    parse_to,
    sparse_nnz,
    storage_expired,
    storage_id,
    storage_key,
    tensor_text,
    version_of,
)

__all__ = [
    "compile_with_inductor",
    "compiles_a_module_call",
    "global_hooks_off",
    "inductor_cache_dir",
    "mode_options",
    "replay_on_fakes",
    "DATA_DEPENDENT_ERRORS",
    "DynamicOutputShapeException",
    "FakeTensor",
    "FakeTensorMode",
    "HigherOrderOperator",
    "MAX_SYMBOLIC_SIZE",
    "MIN_TORCH",
    "MODULE_APPLY",
    "OP_ERRORS",
    "OpOverload",
    "SYMBOLIC_REFERENCES",
    "ShapeEnv",
    "StorageWeakRef",
    "TENSOR_CHECK",
    "TorchDispatchMode",
    "UnsupportedOperatorException",
    "accelerator_hooks",
    "all_true",
    "autograd_sequence_nr",
    "backward_keeping_modes",
    "backward_without_hop",
    "check_with",
    "coo_parts",
    "count_flops",
    "current_autograd_node",
    "data_loading_in_process",
    "destroy_library",
    "dispatch_key_guard",
    "dispatch_modes_pushed",
    "dtensor_sharding_fakes_on",
    "expr_of",
    "fake_like",
    "fake_mode_without_cuda",
    "fake_process_group_store",
    "fakes_shown_on",
    "fakes_take_foreach_paths",
    "fsdp1_handle",
    "fsdp1_local_shard",
    "fsdp1_reshard",
    "fsdp1_runtime",
    "fsdp1_sharded_views_skipped",
    "fsdp_lazy_init",
    "fsdp_storage_modules",
    "generator_started_at",
    "hint_of",
    "holds_fakes",
    "is_cached_tensor",
    "is_fake",
    "is_view",
    "local_tensor",
    "meshes_made_for_real",
    "module_apply",
    "module_buffers",
    "module_children",
    "module_non_persistent_buffers",
    "module_parameters",
    "node_sequence_nr",
    "op_schema",
    "ops_with_kernel_for",
    "outside_modes",
    "parse_to",
    "per_device_caches_cleared",
    "pipeline_backward_meta",
    "pipeline_inference_mode",
    "pipeline_warmup_owners",
    "process_group_sizes",
    "quantized_on_meta",
    "quiet_fake_tensor_logs",
    "schedule_stage",
    "sdp_priority_order",
    "set_module_children",
    "set_stage_inference_mode",
    "shape_guards",
    "size_symbol",
    "sparse_nnz",
    "stage_peer_rank",
    "stage_same_rank",
    "stage_user_meta",
    "storage_expired",
    "storage_id",
    "storage_key",
    "strided_shards_indexed_for_real",
    "tensor_check",
    "tensor_text",
    "to_fake",
    "tree_flatten",
    "tree_map",
    "unpatched_module_apply",
    "unset_fake_temporarily",
    "version_of",
]
