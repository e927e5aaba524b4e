// Causal attention of prompts computed from their first token, packed: each span of a step's tokens attends
// over its own keys and values alone (nothing of it is in the cache before this step).
//
// The engine on the CPU ran one SDPA call per prompt from Python (attention.FreshPrefillGroup); the engine on
// the bridge's device had no packed form at all: its prompts joined the masked group, each padded to the
// group's longest and the group to a bucket of rows, with its keys gathered from the cache, and PyTorch's CPU
// flash attention computed every padded score (at 32 concurrent on the bench model, ~20% of the device's step
// against ~1% on the cpu). Here one call takes the step's flat q, k, v and a [S, 2] table of spans, each span one
// causal flash-attention call on its rows (strided views, no copies in), so a device step with a static number of
// spans (padding spans count 0) computes only the prompts' own causal scores.
//
//   prefill_attention(out, q, k, v, spans, scale)   q [N, H, D], k and v [N, KVH, D] (H a multiple of KVH; rows
//                                                   at any stride, each row's heads contiguous), float32/bf16/
//                                                   fp16, one dtype; spans [S, 2] int64 (first row, row count),
//                                                   in order, disjoint; out [N, H, D] contiguous: span rows get
//                                                   their attention, every other row zeros

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

namespace {

bool rows_ok(const at::Tensor& t) { return t.dim() == 3 && t.stride(2) == 1 && (t.size(1) <= 1 || t.stride(1) == t.size(2)); }

void prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& spans, double scale) {
  TORCH_CHECK(rows_ok(q) && rows_ok(k) && rows_ok(v),
              "prefill_attention: q, k and v must be [N, heads, head_dim] with each row's heads contiguous; got ",
              q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = k.size(1);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == n && k.size(2) == d && kv_heads > 0 && heads % kv_heads == 0,
              "prefill_attention: k and v must be [", n, ", kv_heads, ", d, "] with ", heads,
              " query heads a multiple of kv_heads; got ", k.sizes(), ", ", v.sizes());
  const auto st = q.scalar_type();
  TORCH_CHECK((st == at::kFloat || st == at::kBFloat16 || st == at::kHalf) && k.scalar_type() == st &&
                  v.scalar_type() == st && out.scalar_type() == st,
              "prefill_attention: q, k, v and out float32/bfloat16/float16, one dtype; got ", st, ", ", k.scalar_type(),
              ", ", v.scalar_type(), ", ", out.scalar_type());
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous(), "prefill_attention: out must be contiguous ",
              q.sizes(), "; got ", out.sizes());
  TORCH_CHECK(spans.dim() == 2 && spans.size(1) == 2 && spans.scalar_type() == at::kLong,
              "prefill_attention: spans must be int64 [S, 2] (first row, row count); got ", spans.sizes(), " ",
              spans.scalar_type());
  const at::Tensor table = spans.contiguous();
  const int64_t* s = table.data_ptr<int64_t>();
  const int64_t count = table.size(0), row = heads * d, elem = out.element_size();
  char* o = static_cast<char*>(out.data_ptr());
  int64_t done = 0;  // rows [0, done) are written
  for (int64_t i = 0; i < count; ++i) {
    const int64_t first = s[2 * i], len = s[2 * i + 1];
    if (len == 0) continue;  // a padding span
    TORCH_CHECK(len > 0 && first >= done && first + len <= n, "prefill_attention: span ", i, " (first ", first,
                ", count ", len, ") is not inside rows [", done, ", ", n, ") after the spans before it");
    std::memset(o + done * row * elem, 0, (first - done) * row * elem);
    // [1, heads, len, d] views of the span's rows: SDPA's CPU flash kernel reads them strided
    auto view = [&](const at::Tensor& t) { return t.narrow(0, first, len).transpose(0, 1).unsqueeze(0); };
    const at::Tensor a = at::scaled_dot_product_attention(view(q), view(k), view(v), c10::nullopt, 0.0, true, scale,
                                                          heads != kv_heads);
    out.narrow(0, first, len).copy_(a.squeeze(0).transpose(0, 1));
    done = first + len;
  }
  std::memset(o + done * row * elem, 0, (n - done) * row * elem);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torchbridge_serve, m) {
  m.def("prefill_attention(Tensor(a!) out, Tensor q, Tensor k, Tensor v, Tensor spans, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(torchbridge_serve, CPU, m) { m.impl("prefill_attention", prefill_attention); }
