"""The rollout weight quantizations hybridrl knows (``rollout.quantization``): dense linears
in FP8 (per tensor, or 128x128 blocks with float or UE8M0 power-of-two scales), MoE experts
in MXFP4, or one of each."""

QUANTIZATIONS = (None, "fp8", "fp8_block", "fp8_block_ue8m0", "mxfp4", "fp8+mxfp4", "fp8_block+mxfp4",
                 "fp8_block_ue8m0+mxfp4")
