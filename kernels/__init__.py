"""Triton kernels for QuantWM: the CUDA fast path. One kernel and its launcher per file; the fused attention's typed
arguments (`span_args`: what a span's layout hands the kernel) and its JIT tile helpers (`span_tiles`) live beside
it, and so do the grid helpers the allocator's kernels share (`grid_tiles`).

* `pack_bits` / `unpack_bits`: codes <-> little-endian packed uint8 rows (2/4/8 bits).
* `quantize_pack`: a committed span's codes against its stored scales/zeros, packed, in one pass.
* `kmeans_assign` / `qsac_assign`: nearest centroid under Euclidean distance / QSAC's cost J.
* `channel_errors` / `allocate_levels` / `pack_channels` / `unshrink_channels`: QuantWM's allocator at commit:
  each channel's error at every width and clip, the bit assignment (bisection and greedy fill), the grids and the
  packed codes (with the Values' slope sums), the Values' grids stretched to a slope of 1.
* `trellis_viterbi` / `trellis_choice`: quantwm-trellis's encoder, the bitshift trellis's Viterbi search over a
  span's channels, then each channel's choice of trellis or grid (and the Values' stretch); `pack_channels` packs
  the codes kept from the search's states.
* `span_attention`: a chunk of queries over one cached span (packed, clustered, PSAC-corrected, or full
  precision, or trellis-coded), online softmax carried across spans and splits (flash-decoding).

Installed as `quantwm.kernels` (the distribution claims no top-level name but `quantwm`); it imports
nothing else from quantwm. Each kernel's PyTorch twin is named `<kernel>_ref` and lives
in quantwm/. Launchers never require CUDA tensors, so every kernel also runs under `TRITON_INTERPRET=1`
(set before importing this package), which is how CI checks them on CPU. Tiles are GPU-legal (tl.dot
operands are at least 16 x 16).
"""
