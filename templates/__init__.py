"""dspark.templates."""
