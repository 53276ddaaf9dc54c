"""Engine integrations: each lives in its own subpackage, uses only the public ops of
``wedlm_kernels`` and imports its engine lazily (``import wedlm_kernels`` never imports
one)."""
