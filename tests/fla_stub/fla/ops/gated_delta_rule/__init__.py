"""The two entry points transformers and grpo.kernels.gdn import from FLA; both raise `StubFLACalled`."""


class StubFLACalled(RuntimeError):
    pass


def chunk_gated_delta_rule(q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    raise StubFLACalled("stub fla: chunk_gated_delta_rule called")


def fused_recurrent_gated_delta_rule(q, k, v, g=None, beta=None, scale=None, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None,
                                     **kwargs):
    raise StubFLACalled("stub fla: fused_recurrent_gated_delta_rule called")
