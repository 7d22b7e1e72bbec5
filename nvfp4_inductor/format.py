"""NVFP4 format constants: the one place the magic numbers live (the README's
numerics contract).

An NVFP4 tensor is FP4 E2M1 codes, one FP8 E4M3 scale per 16 consecutive elements along K,
and one FP32 global scale (per tensor, or per row).
"""

# --- element: FP4 E2M1 (1 sign, 2 exponent, 1 mantissa bit) -----------------------------------
# Magnitude index i (0..7) is the code's low 3 bits: i = exponent << 1 | mantissa.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E2M1_SIGN_BIT = 0x8  # code = sign << 3 | magnitude index
# Midpoints between neighbouring magnitudes. A value exactly on midpoint i (between index i and
# i + 1) rounds to the neighbour with an even mantissa bit, i.e. the even index: down when i is
# even, up when i is odd. Hence 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4, the rule
# of the hardware's cvt.rn.satfinite.e2m1x2.f32.
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)

# --- block scale: FP8 E4M3 (torch.float8_e4m3fn: no infinities, 0x7F / 0xFF are NaN) ------------
E4M3_MAX = 448.0
E4M3_NAN_BITS = 0x7F
BLOCK_SIZE = 16  # elements sharing one block scale, along K

# --- global scale ------------------------------------------------------------------------------
# g = amax / (E2M1_MAX * E4M3_MAX): the largest block then gets block scale 448 and codes up to 6.
GLOBAL_SCALE_DIVISOR = E2M1_MAX * E4M3_MAX  # 2688.0
# Below TINY_GLOBAL_SCALE, the element step works on x and g times TINY_SCALE_FACTOR (both products
# exact): r = 1 / (s g) would otherwise lose bits or overflow once s * g falls below fp32's normals.
TINY_GLOBAL_SCALE = 2.0**-100
TINY_SCALE_FACTOR = 2.0**64

# --- swizzled scale layout (cuBLAS / torch._scaled_mm / tcgen05 block-scaled MMA) ---------------
# The (rows, K/16) scale matrix is zero-padded to multiples of (128, 4) and cut into 128x4 tiles
# of 512 bytes, tile-row-major; inside a tile, (r, c) goes to (r % 32) * 16 + (r // 32) * 4 + c.
SWIZZLE_TILE_ROWS = 128
SWIZZLE_TILE_COLS = 4
SWIZZLE_ROW_GROUP = 32  # rows r and r + 32 of a tile are 4 bytes apart
