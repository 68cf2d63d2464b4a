#include "core/npy.h"

#include <cstdio>
#include <cstring>
#include <memory>

#include "core/error.h"
#include "core/mapped_file.h"

namespace turbospark {

void write_npy_f32(const std::string& path, const std::vector<int64_t>& shape, const float* data) {
  std::string dims;
  int64_t n = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    dims += std::to_string(shape[i]);
    if (shape.size() == 1 || i + 1 < shape.size()) dims += ",";
    if (i + 1 < shape.size()) dims += " ";
    n *= shape[i];
  }
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + dims + "), }";
  size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header += '\n';
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(path.c_str(), "wb"), std::fclose);
  if (!f) fail("{}: cannot open for writing", path);
  const char magic[] = "\x93NUMPY\x01\x00";
  uint16_t hlen = uint16_t(header.size());
  bool ok = std::fwrite(magic, 1, 8, f.get()) == 8 && std::fwrite(&hlen, 2, 1, f.get()) == 1 &&
            std::fwrite(header.data(), 1, header.size(), f.get()) == header.size() &&
            std::fwrite(data, sizeof(float), size_t(n), f.get()) == size_t(n);
  if (!ok) fail("{}: write failed", path);
}

NpyArray read_npy_f32(const std::string& path) {
  MappedFile file(path);
  const uint8_t* p = file.data();
  if (file.size() < 10 || std::memcmp(p, "\x93NUMPY", 6) != 0) fail("{}: not a .npy file", path);
  size_t hlen, hstart;
  if (p[6] == 1) {
    hlen = size_t(p[8]) | size_t(p[9]) << 8;
    hstart = 10;
  } else {
    if (file.size() < 12) fail("{}: truncated .npy header", path);
    hlen = size_t(p[8]) | size_t(p[9]) << 8 | size_t(p[10]) << 16 | size_t(p[11]) << 24;
    hstart = 12;
  }
  if (hstart + hlen > file.size()) fail("{}: truncated .npy header", path);
  std::string header(reinterpret_cast<const char*>(p + hstart), hlen);
  if (header.find("'<f4'") == std::string::npos) fail("{}: expected float32 ('<f4') data", path);
  if (header.find("'fortran_order': False") == std::string::npos) fail("{}: expected C order", path);
  NpyArray out;
  size_t lp = header.find('('), rp = header.find(')');
  if (lp == std::string::npos || rp == std::string::npos) fail("{}: no shape in header", path);
  std::string dims = header.substr(lp + 1, rp - lp - 1);
  int64_t n = 1;
  size_t pos = 0;
  while (pos < dims.size()) {
    size_t comma = dims.find(',', pos);
    std::string tok = dims.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    if (tok.find_first_not_of(' ') != std::string::npos) {
      out.shape.push_back(std::stoll(tok));
      n *= out.shape.back();
    }
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  size_t bytes = size_t(n) * 4;
  if (hstart + hlen + bytes > file.size()) fail("{}: truncated data", path);
  out.data.resize(size_t(n));
  std::memcpy(out.data.data(), p + hstart + hlen, bytes);
  return out;
}

}  // namespace turbospark
