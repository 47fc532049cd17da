"""MiniCPM-o-shaped demo encoders and traffic, used by ``omnitrace demo`` and the benchmarks."""
