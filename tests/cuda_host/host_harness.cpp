// Host-side test harness for the CUDA kernels (no GPU needed): runs the kernel bodies and launchers of
// modelopt_lite/csrc/quant_kernels.cu on the CPU (MODELOPT_LITE_EMULATE_ON_HOST) so that tests/test_cuda_host_math.py
// can compare them bit for bit with the pure-torch reference. Built with `nvcc -std=c++17 -O2` (host code only).
//
// Commands, one per line on stdin (files are raw little-endian arrays):
//   elem  N qmin qmax x s zp g out          -> out: N x 12 float32 (see kElemColumns)
//   fwd   op dtype qmin qmax misalign ndim sizes... strides... x scale zp out
//   bwd   op dtype qmin qmax misalign need_term ndim sizes... strides... grad x scale zp gx term
//   hist  dtype rows cols nbins exp_all x exps out   (exps file empty: exp_all for every row)
//   div   n d in out                         -> out: n x 2 uint64 (quotient, remainder) for uint64 numerators
//   plan  ndim sizes... strides...           -> prints "kind ndim C inner" on stdout
// Each command prints "ok <status>" (the cudaError_t of the launcher, 0 = success) or an error line.
#define MODELOPT_LITE_EMULATE_ON_HOST 1
#include "../../modelopt_lite/csrc/quant_kernels.cu"

#include <cstdio>
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

size_t elem_size(int dtype) { return dtype == MLQ_FLOAT32 ? 4 : 2; }

// A buffer whose data starts `misalign` elements past a 16-byte boundary (to exercise the scalar path).
struct Buf {
  std::vector<char> mem;
  size_t off;
  Buf(size_t bytes, size_t misalign_bytes) : mem(bytes + 64), off(0) {
    const uintptr_t base = reinterpret_cast<uintptr_t>(mem.data());
    off = (16 - base % 16) % 16 + misalign_bytes;
  }
  char* data() { return mem.data() + off; }
};

template <class T>
uint32_t bits_of_elem(float f) {
  return static_cast<uint32_t>(mlq::Elem<T>::from_float(f));
}

void cmd_elem(std::istringstream& in) {
  int64_t n;
  int qmin, qmax;
  std::string xf, sf, zf, gf, outf;
  in >> n >> qmin >> qmax >> xf >> sf >> zf >> gf >> outf;
  const auto xb = read_file(xf), sb = read_file(sf), zb = read_file(zf), gb = read_file(gf);
  const float* x = reinterpret_cast<const float*>(xb.data());
  const float* s = reinterpret_cast<const float*>(sb.data());
  const float* z = reinterpret_cast<const float*>(zb.data());
  const float* g = reinterpret_cast<const float*>(gb.data());
  const float lo = static_cast<float>(qmin), hi = static_cast<float>(qmax);
  std::vector<float> out;
  using namespace mlq;
  for (int64_t i = 0; i < n; ++i) {
    const float cols[] = {
        forward_elem<Fwd::IntFake>(x[i], s[i], z[i], lo, hi),
        forward_elem<Fwd::IntCodes>(x[i], s[i], z[i], lo, hi),
        forward_elem<Fwd::E4m3Fake>(x[i], s[i], z[i], lo, hi),
        forward_elem<Fwd::AffineFake>(x[i], s[i], z[i], lo, hi),
        forward_elem<Fwd::AffineCodes>(x[i], s[i], z[i], lo, hi),
        backward_pass<Bwd::Int>(x[i], s[i], z[i], lo, hi) ? 1.0f : 0.0f,
        backward_scale_term<Bwd::Int>(x[i], g[i], s[i], lo, hi),
        backward_pass<Bwd::E4m3>(x[i], s[i], z[i], lo, hi) ? 1.0f : 0.0f,
        backward_scale_term<Bwd::E4m3>(x[i], g[i], s[i], lo, hi),
        backward_pass<Bwd::Affine>(x[i], s[i], z[i], lo, hi) ? 1.0f : 0.0f,
        bits_to_float(bits_of_elem<__half>(x[i])),         // fp16 bits of x (round to nearest even)
        bits_to_float(bits_of_elem<__nv_bfloat16>(x[i])),  // bf16 bits of x
    };
    out.insert(out.end(), std::begin(cols), std::end(cols));
  }
  write_file(outf, out.data(), out.size() * sizeof(float));
  std::cout << "ok 0" << std::endl;
}

bool read_bcast(std::istringstream& in, mlq_broadcast* b, int64_t* n) {
  in >> b->ndim;
  if (b->ndim < 0 || b->ndim > MLQ_MAX_RANK) return false;
  *n = 1;
  for (int d = 0; d < b->ndim; ++d) in >> b->sizes[d], *n *= b->sizes[d];
  for (int d = 0; d < b->ndim; ++d) in >> b->scale_strides[d];
  return true;
}

void cmd_fwd(std::istringstream& in) {
  int op, dtype, qmin, qmax, misalign;
  mlq_broadcast b{};
  int64_t n;
  in >> op >> dtype >> qmin >> qmax >> misalign;
  if (!read_bcast(in, &b, &n)) {
    std::cout << "error bad shape" << std::endl;
    return;
  }
  std::string xf, sf, zf, outf;
  in >> xf >> sf >> zf >> outf;
  const auto xb = read_file(xf), sb = read_file(sf), zb = read_file(zf);
  const size_t es = elem_size(dtype);
  const bool codes = op == MLQ_QUANTIZE_INT || op == MLQ_QUANTIZE_AFFINE;
  const size_t oes = codes ? 4 : es;
  Buf x(n * es, misalign * es), y(n * oes, misalign * oes);
  std::memcpy(x.data(), xb.data(), n * es);
  const cudaError_t st = mlq_forward(static_cast<mlq_forward_op>(op), static_cast<mlq_dtype>(dtype), x.data(),
                                     y.data(), reinterpret_cast<const float*>(sb.data()),
                                     zb.empty() ? nullptr : reinterpret_cast<const float*>(zb.data()), &b, qmin,
                                     qmax, nullptr);
  write_file(outf, y.data(), n * oes);
  std::cout << "ok " << static_cast<int>(st) << std::endl;
}

void cmd_bwd(std::istringstream& in) {
  int op, dtype, qmin, qmax, misalign, need_term;
  mlq_broadcast b{};
  int64_t n;
  in >> op >> dtype >> qmin >> qmax >> misalign >> need_term;
  if (!read_bcast(in, &b, &n)) {
    std::cout << "error bad shape" << std::endl;
    return;
  }
  std::string gf, xf, sf, zf, gxf, tf;
  in >> gf >> xf >> sf >> zf >> gxf >> tf;
  const auto gb = read_file(gf), xb = read_file(xf), sb = read_file(sf), zb = read_file(zf);
  const size_t es = elem_size(dtype);
  Buf g(n * es, misalign * es), x(n * es, misalign * es), gx(n * es, misalign * es), t(n * 4, misalign * 4);
  std::memcpy(g.data(), gb.data(), n * es);
  std::memcpy(x.data(), xb.data(), n * es);
  const cudaError_t st = mlq_backward(
      static_cast<mlq_backward_op>(op), static_cast<mlq_dtype>(dtype), g.data(), x.data(), gx.data(),
      need_term ? reinterpret_cast<float*>(t.data()) : nullptr, reinterpret_cast<const float*>(sb.data()),
      zb.empty() ? nullptr : reinterpret_cast<const float*>(zb.data()), &b, qmin, qmax, nullptr);
  write_file(gxf, gx.data(), n * es);
  write_file(tf, t.data(), need_term ? n * 4 : 0);
  std::cout << "ok " << static_cast<int>(st) << std::endl;
}

void cmd_hist(std::istringstream& in) {
  int dtype;
  int64_t rows, cols, nbins, exp_all;
  std::string xf, ef, outf;
  in >> dtype >> rows >> cols >> nbins >> exp_all >> xf >> ef >> outf;
  const auto xb = read_file(xf), eb = read_file(ef);
  const size_t cells = rows > 0 && nbins > 0 ? static_cast<size_t>(rows * nbins) : 0;
  std::vector<int64_t> counts(cells + 1, 0);
  const cudaError_t st =
      mlq_histogram(static_cast<mlq_dtype>(dtype), xb.data(), rows, cols,
                    eb.empty() ? nullptr : reinterpret_cast<const int64_t*>(eb.data()), exp_all, nbins,
                    counts.data(), nullptr);
  write_file(outf, counts.data(), cells * sizeof(int64_t));
  std::cout << "ok " << static_cast<int>(st) << std::endl;
}

void cmd_div(std::istringstream& in) {
  int64_t n;
  uint64_t d;
  std::string inf, outf;
  in >> n >> d >> inf >> outf;
  const auto nb = read_file(inf);
  const uint64_t* num = reinterpret_cast<const uint64_t*>(nb.data());
  const mlq::FastDivmod fd(d);
  std::vector<uint64_t> out;
  for (int64_t i = 0; i < n; ++i) {
    uint64_t q, r;
    fd.divmod(num[i], q, r);
    out.push_back(q);
    out.push_back(r);
  }
  write_file(outf, out.data(), out.size() * sizeof(uint64_t));
  std::cout << "ok 0" << std::endl;
}

void cmd_plan(std::istringstream& in) {
  mlq_broadcast b{};
  int64_t n;
  if (!read_bcast(in, &b, &n)) {
    std::cout << "error bad shape" << std::endl;
    return;
  }
  mlq::Plan p;
  const bool ok = mlq::make_plan(b.ndim, b.sizes, b.scale_strides, &p);
  std::cout << "plan " << (ok ? static_cast<int>(p.kind) : -1) << " " << p.ndim << " " << p.C << " " << p.inner
            << " " << mlq_layout(&b) << std::endl;
}

}  // namespace

int main() {
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    if (cmd == "elem") cmd_elem(in);
    else if (cmd == "fwd") cmd_fwd(in);
    else if (cmd == "bwd") cmd_bwd(in);
    else if (cmd == "hist") cmd_hist(in);
    else if (cmd == "div") cmd_div(in);
    else if (cmd == "plan") cmd_plan(in);
    else if (!cmd.empty()) std::cout << "error unknown command " << cmd << std::endl;
  }
  return 0;
}
