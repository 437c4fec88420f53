"""HF transformers beside this repo: its top-level `kernels` package has the name of Hugging Face's hub-kernels
package, which transformers (>= 5.2x: a dependency now) imports whenever that distribution is installed. From the
repo root (or an editable install) the import finds ours and fails (`cannot import name 'CUDAProperties' from
'kernels'`), and with it every model import. Tests and tools that use transformers call hide_hub_kernels() first."""
import os


def hide_hub_kernels():
    """Tell transformers the hub kernels are unavailable (CUDA layers from the Hub, never used here) and off
    (USE_HUB_KERNELS, which from_pretrained reads: its default is on), before any of its models is imported. No-op
    without transformers."""
    os.environ["USE_HUB_KERNELS"] = "NO"
    try:
        import transformers.utils as tu
        import transformers.utils.import_utils as iu
    except ImportError:
        return

    def unavailable(*args, **kwargs):
        return False
    iu.is_kernels_available = tu.is_kernels_available = unavailable
