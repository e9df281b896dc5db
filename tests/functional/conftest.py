# CPU shims for this machine (Python 3.11, no TransformerEngine), in place before any test here imports
# megatron.bridge; they do nothing where the real things exist. Not sent upstream.
from mtp_mask_fix.harness import cpu_shims


cpu_shims.install()
