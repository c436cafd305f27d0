"""dspark.kernels."""
