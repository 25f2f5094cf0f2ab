"""epmem.codec: the weight codec through the ctypes binding. Bit-exact round
trips of every bf16 and fp16 bit pattern, odd lengths, raw outcomes that say
why, and corrupt or truncated buffers refused with epmem's message. The CRC is
checked against zlib's, an independent CRC-32."""

import array
import random
import struct
import unittest
import zlib

import epmem
import epmem.codec as codec

ALL = array.array("H", range(65536)).tobytes()  # little-endian on every host epmem runs on


def weight_like(n, seed):
    """bf16 of a rough N(0, 0.02): the top half of f32 of a sum of uniforms."""
    rng = random.Random(seed)
    vals = [(sum(rng.random() for _ in range(4)) - 2.0) * 0.035 for _ in range(n)]
    return b"".join(struct.pack("<f", v)[2:] for v in vals)


class CodecTest(unittest.TestCase):
    def test_every_bit_pattern_round_trips(self):
        for dtype in ("bf16", "fp16"):
            for k in (0, 1, 2, 3, 4):
                for version, k2 in ((1, 0), (0, 1), (0, 3), (0, 4)):
                    buf, info = codec.encode(ALL, dtype, k=k, min_bytes=0, max_ratio=1e9,
                                             format_version=version, k2=k2)
                    self.assertTrue(info.coded, (dtype, k, info))
                    self.assertEqual(len(buf), info.encoded_bytes)
                    self.assertEqual(codec.decode(buf), ALL, (dtype, k, k2))
                    v = codec.validate(buf)
                    self.assertEqual((v.dtype, v.values, v.raw_bytes), (dtype, 65536, 131072))
                    # format_version=1 writes v1; a k2 writes v2 with that width.
                    self.assertEqual((v.format_version, v.k2), (1, 0) if version == 1 else (2, k2))

    def test_odd_lengths_and_buffer_types(self):
        data = weight_like(3 * 4096 + 17, 1)
        for n in (1, 7, 4095, 4096, 4097, 3 * 4096 + 17):
            raw = data[:2 * n]
            for obj in (raw, bytearray(raw), memoryview(raw), array.array("H", raw)):
                buf, info = codec.encode(obj, "bfloat16", min_bytes=0, max_ratio=1e9, threads=2)
                self.assertEqual(codec.decode(buf), raw, (n, type(obj)))

    def test_a_weight_like_tensor_compresses_below_070(self):
        raw = weight_like(1 << 20, 2)
        buf, info = codec.encode(raw, "bf16")
        self.assertTrue(info.coded)
        self.assertTrue(0.6 < info.ratio < 0.75, info)
        # Two-level escapes (format v2) by default, smaller than v1.
        self.assertEqual(info.format_version, 2, info)
        _, v1 = codec.encode(raw, "bf16", format_version=1)
        self.assertEqual(v1.format_version, 1)
        self.assertLess(info.encoded_bytes, v1.encoded_bytes)
        self.assertEqual(codec.plan(raw, "bf16"), info)
        self.assertEqual(codec.decode(buf), raw)

    def test_raw_outcomes_say_why(self):
        buf, info = codec.encode(weight_like(1000, 3), "bf16")
        self.assertIsNone(buf)
        self.assertEqual((info.outcome, info.raw_bytes, info.encoded_bytes), ("raw_too_small", 2000, 0))
        noise = random.Random(4).randbytes(2 << 20)
        buf, info = codec.encode(noise, "bf16")
        self.assertIsNone(buf)
        self.assertEqual(info.outcome, "raw_no_gain")
        self.assertGreaterEqual(info.ratio, 0.9)
        buf, info = codec.encode(noise, "other")
        self.assertEqual((buf, info.outcome), (None, "raw_unsupported_dtype"))

    def test_bad_input_raises_with_epmem_message(self):
        with self.assertRaises(epmem.InvalidArgument) as cm:
            codec.encode(b"\x00" * 7, "bf16", min_bytes=0)
        self.assertIn("not a whole number", str(cm.exception))
        with self.assertRaises(epmem.InvalidArgument):
            codec.encode(b"\x00" * 8, 99)
        with self.assertRaises(ValueError):
            codec.encode(b"\x00" * 8, "int4")
        with self.assertRaises(epmem.InvalidArgument):
            codec.encode(b"\x00" * 8, "fp16", k=5, min_bytes=0)

    def test_corrupt_and_truncated_buffers_are_refused(self):
        buf, _ = codec.encode(weight_like(9000, 5), "bf16", min_bytes=0)
        # The checksum is CRC-32 (zlib's) of the buffer less its own field.
        self.assertEqual(struct.unpack_from("<I", buf, 124)[0], zlib.crc32(buf[128:], zlib.crc32(buf[:124])))
        rng = random.Random(6)
        for at in [0, 4, 8, 9, 16, 64, 100, 124] + [rng.randrange(128, len(buf)) for _ in range(40)]:
            bad = bytearray(buf)
            bad[at] ^= 1 << rng.randrange(8)
            with self.assertRaises(epmem.InvalidArgument) as cm:
                codec.decode(bytes(bad))
            self.assertIn("refused", str(cm.exception))
        for n in (1, 127, 128, len(buf) - 1):
            with self.assertRaises(epmem.InvalidArgument) as cm:
                codec.validate(buf[:n])
            self.assertIn("truncated", str(cm.exception))


if __name__ == "__main__":
    unittest.main()
