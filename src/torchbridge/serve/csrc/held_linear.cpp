// Linear layers whose weights the engine's kernel library holds, pre-packed for oneDNN, by a key.
//
// The engine on the bridge's device runs each step as one XLA program, and XLA:CPU multiplies 16-bit
// floats in float32. oneDNN's packed bf16 GEMM (what the engine on the CPU calls, serve/linear.py) reads
// half the bytes and, on a CPU with AVX512-BF16, does twice the multiply-adds per instruction. Its packed
// weight is an opaque oneDNN tensor, not memory an XLA buffer could hold, so the engine hands it to this
// library once (`hold_packed_weight`, under a key derived from the weight's contents) and the device's
// custom call (device/csrc/host_calls.cpp) calls `held_linear` with that key and its input's buffer.
//
// Float32 weights (and, on AVX2 CPUs without a oneDNN 16-bit GEMM, 16-bit ones) it holds in the panel layout
// of its own kernel instead (`hold_panel_weight`, serve/csrc/panel_linear.cpp): oneDNN's float32 GEMM, like
// XLA:CPU's dot, leaves much of the core idle at a decode step's rows. A held weight is either form;
// `held_linear` multiplies by whichever the key names, x in float32 or 16 bits (widened, rounded once).
//
// A packed bf16 weight may also carry the AMX tile layout (`hold_tiles`, serve/linear.py amx_layout): calls of
// up to its row limit then run the engine's tile kernel (amx_linear or avx512bf16_linear) instead of oneDNN,
// which spends tens of microseconds around a small layer's weight stream at a decode step's few rows.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>

#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

namespace {

struct Held {
  at::Tensor packed;  // from mkldnn::_reorder_linear_weight; undefined for a weight held as panels
  at::Tensor panels;  // float32 [ceil(N/16), K, 16] (serve/linear.py panel_layout); undefined for a packed one
  std::optional<at::Tensor> bias;  // the packed weight's dtype, or float32 beside panels
  at::Tensor tiles;  // bf16 [N/32, K/32, 2, 16, 32] beside `packed` (hold_tiles); undefined without
  bool tile_amx = false;  // the kernel that multiplies by `tiles`: amx_linear, else avx512bf16_linear
  int64_t tile_max_rows = 0;  // calls of at most this many rows go to it
  int64_t in_features = 0;
  int64_t out_features = 0;
};

std::mutex g_lock;
std::unordered_map<int64_t, Held>& held() {
  static std::unordered_map<int64_t, Held> table;
  return table;
}

void hold_packed_weight(int64_t key, at::Tensor packed, std::optional<at::Tensor> bias, int64_t in_features,
                        int64_t out_features) {
  std::lock_guard<std::mutex> guard(g_lock);
  held()[key] = Held{.packed = std::move(packed), .bias = std::move(bias), .in_features = in_features,
                     .out_features = out_features};
}

void hold_tiles(int64_t key, at::Tensor tiles, const std::string& kernel, int64_t max_rows) {
  TORCH_CHECK(kernel == "amx" || kernel == "avx512bf16", "hold_tiles: kernel must be \"amx\" or \"avx512bf16\"; got \"",
              kernel, "\"");
  std::lock_guard<std::mutex> guard(g_lock);
  auto it = held().find(key);
  TORCH_CHECK(it != held().end() && it->second.packed.defined(), "hold_tiles: no packed weight is held under key ", key);
  Held& h = it->second;
  TORCH_CHECK(tiles.dim() == 5 && tiles.size(0) * 32 == h.out_features && tiles.size(1) * 32 == h.in_features &&
                  tiles.size(2) == 2 && tiles.size(3) == 16 && tiles.size(4) == 32 &&
                  tiles.scalar_type() == at::kBFloat16 && tiles.is_contiguous(),
              "hold_tiles: tiles must be contiguous bfloat16 [", h.out_features / 32, ", ", h.in_features / 32,
              ", 2, 16, 32]; got ", tiles.sizes(), " ", tiles.scalar_type());
  h.tiles = std::move(tiles);
  h.tile_amx = kernel == "amx";
  h.tile_max_rows = max_rows;
}

void hold_panel_weight(int64_t key, at::Tensor panels, std::optional<at::Tensor> bias, int64_t in_features,
                       int64_t out_features) {
  TORCH_CHECK(panels.dim() == 3 && panels.size(0) == (out_features + 15) / 16 && panels.size(1) == in_features &&
                  panels.size(2) == 16 && panels.scalar_type() == at::kFloat && panels.is_contiguous(),
              "hold_panel_weight: panels must be contiguous float32 [", (out_features + 15) / 16, ", ", in_features,
              ", 16]; got ", panels.sizes(), " ", panels.scalar_type());
  std::lock_guard<std::mutex> guard(g_lock);
  held()[key] = Held{.panels = std::move(panels), .bias = std::move(bias), .in_features = in_features,
                     .out_features = out_features};
}

int64_t held_weights() {
  std::lock_guard<std::mutex> guard(g_lock);
  return static_cast<int64_t>(held().size());
}

void release_held_weights() {
  std::lock_guard<std::mutex> guard(g_lock);
  held().clear();
}

// out [M, N] = x [M, K] @ W.T + b, with W and b held under `key`.
void held_linear(at::Tensor out, const at::Tensor& x, int64_t key) {
  Held h;
  {
    std::lock_guard<std::mutex> guard(g_lock);
    auto it = held().find(key);
    TORCH_CHECK(it != held().end(), "held_linear: no weight is held under key ", key,
                " (a program compiled for another model or process?)");
    h = it->second;
  }
  TORCH_CHECK(x.dim() == 2 && x.size(1) == h.in_features, "held_linear: x must be [rows, ", h.in_features, "]; got ",
              x.sizes());
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == h.out_features &&
                  out.scalar_type() == x.scalar_type(),
              "held_linear: out must be [", x.size(0), ", ", h.out_features, "] of x's dtype; got ", out.sizes(), " ",
              out.scalar_type());
  if (x.size(0) == 0) return;
  c10::InferenceMode mode;
  if (h.panels.defined()) {
    static const c10::OperatorHandle& panel = c10::Dispatcher::singleton().findSchemaOrThrow("torchbridge_serve::panel_linear", "");
    const bool f32 = x.scalar_type() == at::kFloat;
    at::Tensor y = f32 ? out : at::empty(out.sizes(), out.options().dtype(at::kFloat));
    torch::jit::Stack stack{y, x.to(at::kFloat).contiguous(), h.panels, h.bias};
    panel.callBoxed(&stack);
    if (!f32) out.copy_(y);
    return;
  }
  if (h.tiles.defined() && x.size(0) <= h.tile_max_rows && x.scalar_type() == at::kBFloat16 && out.is_contiguous()) {
    static const c10::OperatorHandle& amx = c10::Dispatcher::singleton().findSchemaOrThrow("torchbridge_serve::amx_linear", "");
    static const c10::OperatorHandle& avx = c10::Dispatcher::singleton().findSchemaOrThrow("torchbridge_serve::avx512bf16_linear", "");
    torch::jit::Stack stack{out, x.contiguous(), h.tiles, h.bias};
    (h.tile_amx ? amx : avx).callBoxed(&stack);
    return;
  }
  static const c10::OperatorHandle& op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x.contiguous(), h.packed, h.bias, std::string("none"),
                          c10::List<std::optional<at::Scalar>>(), std::optional<std::string>(std::string(""))};
  op.callBoxed(&stack);
  out.copy_(stack[0].toTensor());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torchbridge_serve, m) {
  m.def("hold_packed_weight(int key, Tensor packed, Tensor? bias, int in_features, int out_features) -> ()",
        hold_packed_weight);
  m.def("hold_panel_weight(int key, Tensor panels, Tensor? bias, int in_features, int out_features) -> ()",
        hold_panel_weight);
  m.def("hold_tiles(int key, Tensor tiles, str kernel, int max_rows) -> ()", hold_tiles);
  m.def("held_weights() -> int", held_weights);
  m.def("release_held_weights() -> ()", release_held_weights);
  m.def("held_linear(Tensor(a!) out, Tensor x, int key) -> ()");
}

TORCH_LIBRARY_IMPL(torchbridge_serve, CPU, m) { m.impl("held_linear", held_linear); }
