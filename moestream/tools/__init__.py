"""The layer's tools, apart from its data path: the command line (``cli``), benchmarks
(``bench``, ``bench_ep``, ``bench_kernels``, ``bench_layer``), the link and kernel probe
(``probe``), sm_90a compile facts (``aot``), timelines (``trace``), the streaming simulator
(``sim``), the baselines the benchmarks compare against (``baselines``), standalone fp8 / fp4
grouped GEMM launchers (``fp8``, ``fp4``) and a multi-process ``spawn`` (``distributed``).

The layer never imports this package."""
