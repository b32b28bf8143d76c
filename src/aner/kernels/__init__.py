"""GPU kernels, each beside the pure-torch reference it is tested against."""


def fused_available() -> bool:
    """True when the fused NF4 kernels can run: they are not part of this build yet."""
    return False
