import os

# Kernels run under the Triton interpreter on CPU; this must be set before anything imports kernels/.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
