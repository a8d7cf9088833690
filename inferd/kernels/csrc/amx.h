// The AMX tiles (Sapphire Rapids and later): the tile configuration; amx_linear_native (linears_bf16.cpp) asks the
// process's permission.
#pragma once
#include <cstdint>
#if defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
constexpr int64_t AMX_MAX_ROWS = 64;

#if defined(__AMX_BF16__)
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
#endif
