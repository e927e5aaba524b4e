// torch.autocast(device_type="tpu"): the cast policies PyTorch applies on CUDA, registered for the
// device's autocast key (PyTorch registers them for its in-tree devices only). Products,
// convolutions and attention run in the autocast dtype (bf16 or fp16); the numerically delicate ops
// (exp, log, norms, losses, softmax, sums) in float32 (torch.norm's two
// overloads, which CUDA casts with an appended dtype argument, are left to the fallthrough); mixed-input ops at the widest input type.
#include <ATen/autocast_mode.h>
#include <torch/library.h>

TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) { m.fallback(torch::CppFunction::makeFallthrough()); }

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
#define TB_LOWER(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define TB_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define TB_FP32_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define TB_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
  AT_FORALL_LOWER_PRECISION_FP(TB_LOWER)
  AT_FORALL_FP32(TB_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(TB_FP32_OPT_DTYPE)
  AT_FORALL_PROMOTE(TB_PROMOTE)
#undef TB_LOWER
#undef TB_FP32
#undef TB_FP32_OPT_DTYPE
#undef TB_PROMOTE
}
