"""epmem.torch.offloadable_bytes: what offload() would move, before offloading (to
pick a budget), equal to the offload handle's offloaded_bytes for the default
selection, a custom include= and custom blocks=. On whatever EPM_DEVICE opens
(host in CI: a CPU module)."""

import os
import unittest

try:
    import torch
    from torch import nn
except ImportError:
    torch = None

if torch is not None:
    import epmem.torch as et


def _tdev():
    return torch.device("cuda", 0) if os.environ.get("EPM_DEVICE") == "cuda" else torch.device("cpu")


if torch is not None:
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(64, 256)
            self.down = nn.Linear(256, 64, bias=False)
            self.norm = nn.LayerNorm(64)

        def forward(self, x):
            return self.norm(x + self.down(torch.relu(self.up(x))))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(32, 64)
            self.blocks = nn.ModuleList(Block() for _ in range(3))
            self.head = nn.Linear(64, 32)

        def forward(self, ids):
            x = self.embed(ids)
            for b in self.blocks:
                x = b(x)
            return self.head(x)


@unittest.skipIf(torch is None, "torch is not installed")
class OffloadableBytes(unittest.TestCase):
    def setUp(self):
        torch.manual_seed(0)
        self.net = Net().to(_tdev()).eval()

    def offloaded(self, **kw):
        before = et.offloadable_bytes(self.net, **kw)
        h = et.offload(self.net, 1 << 30, **kw)
        try:
            return before, h.offloaded_bytes
        finally:
            h.remove()

    def test_matches_what_offload_moves(self):
        linear = (64 * 256 + 256 + 256 * 64) * 4  # up (weight + bias) and down, float32
        before, moved = self.offloaded()
        self.assertEqual(before, 3 * linear)
        self.assertEqual(before, moved)
        # Nothing was moved by asking.
        self.assertEqual(self.net.blocks[0].up.weight.device.type, _tdev().type)

    def test_include_and_blocks(self):
        before, moved = self.offloaded(include=lambda name, sub: name == "up")
        self.assertEqual(before, moved)
        self.assertEqual(before, 3 * (64 * 256 + 256) * 4)
        before, moved = self.offloaded(blocks=[self.net.blocks[1]],
                                       include=lambda name, sub: isinstance(sub, (nn.Linear, nn.LayerNorm)))
        self.assertEqual(before, moved)
        self.assertEqual(before, (64 * 256 + 256 + 256 * 64 + 2 * 64) * 4)

    def test_a_module_without_blocks_is_refused_as_offload_refuses_it(self):
        with self.assertRaises(et.OffloadError):
            et.offloadable_bytes(nn.Linear(4, 4))


if __name__ == "__main__":
    unittest.main()
