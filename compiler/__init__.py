"""dspark.compiler."""
