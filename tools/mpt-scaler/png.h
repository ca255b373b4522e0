#pragma once
// An RGB raster and a PNG writer (zlib for the deflate stream and the CRCs).
#include <cstdint>
#include <string>
#include <vector>

namespace mpt::tools {

struct Rgb {
  uint8_t r = 255, g = 255, b = 255;
};

class Canvas {
 public:
  Canvas(int width, int height, Rgb background = {});
  int width() const { return width_; }
  int height() const { return height_; }
  void set(int x, int y, Rgb c);  // clipped
  // Bresenham, `thickness` pixels wide.
  void line(int x0, int y0, int x1, int y1, Rgb c, int thickness = 1);
  // Digits, '.', '-', 'e', '^' in a 3x5 font scaled by `scale`.
  void text(int x, int y, const std::string& s, Rgb c, int scale = 2);
  const std::vector<uint8_t>& pixels() const { return pixels_; }

 private:
  int width_, height_;
  std::vector<uint8_t> pixels_;  // row-major RGB
};

// Writes an 8-bit RGB PNG; IOError naming the path on failure.
void write_png(const std::string& path, const Canvas& canvas);

}  // namespace mpt::tools
