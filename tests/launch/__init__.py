"""Launch tests: real processes started as a user starts them (``subprocess``, ``torchrun``, the
CLI and Hydra scripts, the README's example), signals sent to them and faults injected in them."""
