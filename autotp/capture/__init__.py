"""Stage 1: an ``nn.Module`` and example inputs -> an ATen-level ``torch.fx.GraphModule``."""

from autotp.capture.export import capture, example_specs, inputs_from_specs

__all__ = ["capture", "example_specs", "inputs_from_specs"]
