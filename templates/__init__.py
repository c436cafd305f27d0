"""dspark.templates: jinja2 templates of the DSpark Triton kernels (package data)."""
