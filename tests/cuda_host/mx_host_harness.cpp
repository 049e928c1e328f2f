// Host-side harness for the CUDA kernels of the 4-bit and microscaling formats (no GPU needed): runs the kernel
// bodies and launchers of modelopt_lite/csrc/mx_kernels.cu on the CPU (MODELOPT_LITE_EMULATE_ON_HOST) so that
// tests/test_native_mx_cuda_host.py can compare them bit for bit with the reference. Built with nvcc (host code).
//
// Commands, one per line on stdin (files are raw little-endian arrays; dtype 0/1/2 = float32/float16/bfloat16):
//   nvfp4 dtype rows cols block gs misalign x y scales
//   mx    dtype elem rceil rows cols misalign x y exps
//   mini  dtype elem n channels inner x scale y
// Each prints "ok <cudaError_t> <nonfinite flag>".
#define MODELOPT_LITE_EMULATE_ON_HOST 1
#include "../../modelopt_lite/csrc/mx_kernels.cu"

#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace {

std::vector<char> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<char>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

void write_file(const std::string& path, const void* data, size_t bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
}

// A copy of `src` whose data starts `misalign` bytes past a 16-byte boundary (exercises the element-wise path).
struct Buf {
  std::vector<char> mem;
  size_t off;
  Buf(const std::vector<char>& src, size_t bytes, size_t misalign) : mem(bytes + 64), off(0) {
    off = (16 - reinterpret_cast<uintptr_t>(mem.data()) % 16) % 16 + misalign;
    if (!src.empty()) memcpy(mem.data() + off, src.data(), bytes);
  }
  char* data() { return mem.data() + off; }
};

size_t esize(int dt) { return dt == 0 ? 4 : 2; }

}  // namespace

int main() {
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    int bad = 0;
    cudaError_t st = cudaErrorInvalidValue;
    if (cmd == "nvfp4" || cmd == "mx") {
      int dt, elem = 0, rceil = 0, block = 32, mis;
      int64_t rows, cols;
      float gs = 0.0f;
      std::string xf, yf, sf;
      if (cmd == "nvfp4") {
        in >> dt >> rows >> cols >> block >> gs >> mis >> xf >> yf >> sf;
      } else {
        in >> dt >> elem >> rceil >> rows >> cols >> mis >> xf >> yf >> sf;
      }
      const size_t n = static_cast<size_t>(rows * cols), bytes = n * esize(dt);
      Buf x(read_file(xf), bytes, static_cast<size_t>(mis)), y({}, bytes, static_cast<size_t>(mis));
      std::vector<float> s(static_cast<size_t>(rows * ((cols + block - 1) / block)) + 1);
      st = cmd == "nvfp4" ? mlq_fake_nvfp4(static_cast<mlq_dtype>(dt), x.data(), y.data(), s.data(), rows, cols, block,
                                           &gs, &bad, nullptr)
                          : mlq_fake_mx(static_cast<mlq_dtype>(dt), elem, rceil, x.data(), y.data(), s.data(), rows,
                                        cols, block, &bad, nullptr);
      write_file(yf, y.data(), bytes);
      write_file(sf, s.data(), (s.size() - 1) * sizeof(float));
    } else if (cmd == "mini") {
      int dt, elem;
      int64_t n, channels, inner;
      std::string xf, sf, yf;
      in >> dt >> elem >> n >> channels >> inner >> xf >> sf >> yf;
      const std::vector<char> xb = read_file(xf), sb = read_file(sf);
      std::vector<char> yb(static_cast<size_t>(n) * esize(dt));
      st = mlq_fake_minifloat(static_cast<mlq_dtype>(dt), elem, xb.data(), yb.data(),
                              reinterpret_cast<const float*>(sb.data()), n, channels, inner, nullptr);
      write_file(yf, yb.data(), yb.size());
    }
    std::cout << "ok " << static_cast<int>(st) << " " << bad << std::endl;
  }
  return 0;
}
