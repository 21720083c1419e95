"""The quantization core: group quantizers and bit packing, k-means, QSAC, PSAC, the method registry, the
chunked KV cache, span attention and the running query statistics (docs/method.md §2, docs/architecture.md)."""
