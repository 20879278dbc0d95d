// Dataset index helpers (Megatron-LM semantics), built as megatron_like._csrc.dataset_helpers.
//
// build_sample_idx_int32/int64(sizes int32[D], doc_idx int32[E], seq_length, num_epochs, tokens_per_epoch)
//   -> [num_samples + 1, 2] (position in doc_idx, token offset) where each sample starts. Each sample
//   takes seq_length + 1 tokens; the last token of one sample is the first of the next.
// build_blending_indices(dataset_index int16[size] out, dataset_sample_index int64[size] out,
//   weights float64[num_datasets], size): greedy interleave, sample i goes to
//   argmax_d(w_d * max(i, 1) - count_d), the first dataset on ties.
// The Python fallbacks live in megatron_like/data/index_helpers.py and give identical arrays.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <vector>

namespace py = pybind11;

template <typename T>
py::array_t<T> build_sample_idx(const py::array_t<int32_t, py::array::c_style | py::array::forcecast>& sizes_,
                                const py::array_t<int32_t, py::array::c_style | py::array::forcecast>& doc_idx_,
                                int32_t seq_length, int64_t num_epochs, int64_t tokens_per_epoch) {
  if (seq_length <= 0) throw std::invalid_argument("seq_length must be positive");
  const int32_t* sizes = sizes_.data();
  const int32_t* doc_idx = doc_idx_.data();
  const int64_t num_sizes = sizes_.size();
  const int64_t doc_idx_len = doc_idx_.size();
  const int64_t num_samples = (num_epochs * tokens_per_epoch - 1) / seq_length;

  py::array_t<T> result({num_samples + 1, static_cast<int64_t>(2)});
  T* out = result.mutable_data();
  {
    py::gil_scoped_release release;
    int64_t sample = 0;
    int64_t position = 0;  // index into doc_idx
    int64_t offset = 0;    // token offset inside doc_idx[position]
    out[0] = 0;
    out[1] = 0;
    ++sample;
    while (sample <= num_samples) {
      int64_t remaining = static_cast<int64_t>(seq_length) + 1;
      while (remaining != 0) {
        if (position >= doc_idx_len) throw std::out_of_range("doc_idx exhausted: too few tokens for the samples");
        const int32_t doc = doc_idx[position];
        if (doc < 0 || doc >= num_sizes) throw std::out_of_range("doc_idx holds a document id outside sizes");
        const int64_t doc_length = static_cast<int64_t>(sizes[doc]) - offset;
        remaining -= doc_length;
        if (remaining <= 0) {
          // The sample ends inside this document; the next one starts on its last token (-1: overlap).
          offset += remaining + doc_length - 1;
          remaining = 0;
        } else {
          ++position;
          offset = 0;
        }
      }
      out[2 * sample] = static_cast<T>(position);
      out[2 * sample + 1] = static_cast<T>(offset);
      ++sample;
    }
  }
  return result;
}

void build_blending_indices(py::array_t<int16_t, py::array::c_style>& dataset_index_,
                            py::array_t<int64_t, py::array::c_style>& dataset_sample_index_,
                            const py::array_t<double, py::array::c_style | py::array::forcecast>& weights_,
                            int64_t size) {
  if (dataset_index_.size() < size || dataset_sample_index_.size() < size)
    throw std::invalid_argument("output arrays are shorter than size");
  const int64_t num_datasets = weights_.size();
  if (num_datasets <= 0) throw std::invalid_argument("no weights");
  const double* weights = weights_.data();
  int16_t* dataset_index = dataset_index_.mutable_data();
  int64_t* dataset_sample_index = dataset_sample_index_.mutable_data();
  py::gil_scoped_release release;
  std::vector<int64_t> counts(num_datasets, 0);
  for (int64_t i = 0; i < size; ++i) {
    const double scale = std::max(static_cast<double>(i), 1.0);
    int64_t best = 0;
    double best_error = weights[0] * scale - static_cast<double>(counts[0]);
    for (int64_t d = 1; d < num_datasets; ++d) {
      const double error = weights[d] * scale - static_cast<double>(counts[d]);
      if (error > best_error) {
        best_error = error;
        best = d;
      }
    }
    dataset_index[i] = static_cast<int16_t>(best);
    dataset_sample_index[i] = counts[best];
    ++counts[best];
  }
}

PYBIND11_MODULE(dataset_helpers, m) {
  m.doc() = "Megatron-style GPT dataset index helpers (sample index, blending interleave).";
  m.def("build_sample_idx_int32", &build_sample_idx<int32_t>, py::arg("sizes"), py::arg("doc_idx"),
        py::arg("seq_length"), py::arg("num_epochs"), py::arg("tokens_per_epoch"));
  m.def("build_sample_idx_int64", &build_sample_idx<int64_t>, py::arg("sizes"), py::arg("doc_idx"),
        py::arg("seq_length"), py::arg("num_epochs"), py::arg("tokens_per_epoch"));
  m.def("build_blending_indices", &build_blending_indices, py::arg("dataset_index"),
        py::arg("dataset_sample_index"), py::arg("weights"), py::arg("size"));
}
