#include "tools/mpt-scaler/png.h"

#include <zlib.h>

#include <cstdlib>
#include <fstream>

#include "tensor/error.h"

namespace mpt::tools {
namespace {

// 3x5 glyphs, one row per 3-bit number (bit 2 = left column).
const uint8_t* glyph(char c) {
  static const uint8_t digits[10][5] = {{7, 5, 5, 5, 7}, {2, 6, 2, 2, 7}, {7, 1, 7, 4, 7}, {7, 1, 7, 1, 7},
                                        {5, 5, 7, 1, 1}, {7, 4, 7, 1, 7}, {7, 4, 7, 5, 7}, {7, 1, 1, 1, 1},
                                        {7, 5, 7, 5, 7}, {7, 5, 7, 1, 7}};
  static const uint8_t dot[5] = {0, 0, 0, 0, 2}, minus[5] = {0, 0, 7, 0, 0}, e[5] = {7, 4, 7, 4, 7},
                       caret[5] = {2, 5, 0, 0, 0};
  if (c >= '0' && c <= '9') return digits[c - '0'];
  if (c == '.') return dot;
  if (c == '-') return minus;
  if (c == 'e') return e;
  if (c == '^') return caret;
  return nullptr;
}

void put_u32(std::string& out, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) out += static_cast<char>((v >> shift) & 0xff);
}

void put_chunk(std::string& out, const char* type, const std::string& data) {
  put_u32(out, static_cast<uint32_t>(data.size()));
  std::string body = std::string(type, 4) + data;
  out += body;
  put_u32(out, static_cast<uint32_t>(crc32(0, reinterpret_cast<const Bytef*>(body.data()), static_cast<uInt>(body.size()))));
}

}  // namespace

Canvas::Canvas(int width, int height, Rgb background) : width_(width), height_(height) {
  check(width > 0 && height > 0 && width <= 16384 && height <= 16384, "Canvas: size {}x{} out of range", width, height);
  pixels_.resize(static_cast<size_t>(width) * height * 3);
  for (size_t i = 0; i < pixels_.size(); i += 3) {
    pixels_[i] = background.r;
    pixels_[i + 1] = background.g;
    pixels_[i + 2] = background.b;
  }
}

void Canvas::set(int x, int y, Rgb c) {
  if (x < 0 || y < 0 || x >= width_ || y >= height_) return;
  const size_t i = (static_cast<size_t>(y) * width_ + x) * 3;
  pixels_[i] = c.r;
  pixels_[i + 1] = c.g;
  pixels_[i + 2] = c.b;
}

void Canvas::line(int x0, int y0, int x1, int y1, Rgb c, int thickness) {
  const int dx = std::abs(x1 - x0), sx = x0 < x1 ? 1 : -1;
  const int dy = -std::abs(y1 - y0), sy = y0 < y1 ? 1 : -1;
  int err = dx + dy;
  while (true) {
    for (int tx = 0; tx < thickness; ++tx)
      for (int ty = 0; ty < thickness; ++ty) set(x0 + tx - thickness / 2, y0 + ty - thickness / 2, c);
    if (x0 == x1 && y0 == y1) break;
    const int e2 = 2 * err;
    if (e2 >= dy) err += dy, x0 += sx;
    if (e2 <= dx) err += dx, y0 += sy;
  }
}

void Canvas::text(int x, int y, const std::string& s, Rgb c, int scale) {
  for (char ch : s) {
    if (const uint8_t* g = glyph(ch))
      for (int row = 0; row < 5; ++row)
        for (int col = 0; col < 3; ++col)
          if (g[row] & (4 >> col))
            for (int py = 0; py < scale; ++py)
              for (int px = 0; px < scale; ++px) set(x + col * scale + px, y + row * scale + py, c);
    x += 4 * scale;
  }
}

void write_png(const std::string& path, const Canvas& canvas) {
  // Each scanline starts with filter type 0 (none).
  const size_t row_bytes = static_cast<size_t>(canvas.width()) * 3;
  std::string raw;
  raw.reserve((row_bytes + 1) * canvas.height());
  for (int y = 0; y < canvas.height(); ++y) {
    raw += '\0';
    raw.append(reinterpret_cast<const char*>(canvas.pixels().data() + y * row_bytes), row_bytes);
  }
  uLongf packed_size = compressBound(static_cast<uLong>(raw.size()));
  std::string packed(packed_size, '\0');
  const int status = compress2(reinterpret_cast<Bytef*>(packed.data()), &packed_size,
                               reinterpret_cast<const Bytef*>(raw.data()), static_cast<uLong>(raw.size()), 9);
  check<IOError>(status == Z_OK, "write_png: zlib compress failed ({}) for '{}'", status, path);
  packed.resize(packed_size);

  std::string png = "\x89PNG\r\n\x1a\n";
  std::string header;
  put_u32(header, static_cast<uint32_t>(canvas.width()));
  put_u32(header, static_cast<uint32_t>(canvas.height()));
  header += std::string("\x08\x02\x00\x00\x00", 5);  // 8-bit, RGB, deflate, no filter choice, no interlace
  put_chunk(png, "IHDR", header);
  put_chunk(png, "IDAT", packed);
  put_chunk(png, "IEND", "");
  std::ofstream out(path, std::ios::binary);
  check<IOError>(out.good(), "write_png: cannot open '{}' for writing", path);
  out.write(png.data(), static_cast<std::streamsize>(png.size()));
  out.flush();  // a write that fails only when the buffer goes out shows here
  check<IOError>(out.good(), "write_png: writing '{}' failed", path);
}

}  // namespace mpt::tools
