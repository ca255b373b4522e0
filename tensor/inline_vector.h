#pragma once
// A sequence of trivially copyable values with std::vector's interface (the
// part of it the project uses) that holds up to N of them inside the object
// and moves to the heap only beyond that. Shapes and strides are such
// sequences: nearly every op makes a few, and as vectors they were most of
// the host's allocations in an eager step.
#include <algorithm>
#include <compare>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <iterator>
#include <new>
#include <stdexcept>
#include <type_traits>
#include <utility>
#include <vector>

namespace mpt {

template <typename T, size_t N>
class InlineVector {
  static_assert(std::is_trivially_copyable_v<T>, "InlineVector copies its values as bytes");
  static_assert(N > 0);

 public:
  using value_type = T;
  using size_type = size_t;
  using difference_type = std::ptrdiff_t;
  using reference = T&;
  using const_reference = const T&;
  using pointer = T*;
  using const_pointer = const T*;
  using iterator = T*;
  using const_iterator = const T*;
  using reverse_iterator = std::reverse_iterator<iterator>;
  using const_reverse_iterator = std::reverse_iterator<const_iterator>;

  InlineVector() = default;
  explicit InlineVector(size_t n, const T& value = T()) { assign(n, value); }
  InlineVector(std::initializer_list<T> values) { assign(values.begin(), values.end()); }
  template <std::input_iterator It>
  InlineVector(It first, It last) {
    assign(first, last);
  }
  // Interchangeable with a vector of the same values, both ways: callers
  // hold sizes and indices in vectors too.
  InlineVector(const std::vector<T>& values) { assign(values.begin(), values.end()); }  // NOLINT
  operator std::vector<T>() const { return std::vector<T>(begin(), end()); }            // NOLINT

  InlineVector(const InlineVector& other) { assign(other.begin(), other.end()); }
  InlineVector(InlineVector&& other) noexcept { take(other); }
  InlineVector& operator=(const InlineVector& other) {
    if (this != &other) assign(other.begin(), other.end());
    return *this;
  }
  InlineVector& operator=(InlineVector&& other) noexcept {
    if (this != &other) {
      release();
      take(other);
    }
    return *this;
  }
  InlineVector& operator=(std::initializer_list<T> values) {
    assign(values.begin(), values.end());
    return *this;
  }
  ~InlineVector() { release(); }

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  size_t capacity() const { return capacity_; }
  T* data() { return data_; }
  const T* data() const { return data_; }

  iterator begin() { return data_; }
  iterator end() { return data_ + size_; }
  const_iterator begin() const { return data_; }
  const_iterator end() const { return data_ + size_; }
  const_iterator cbegin() const { return begin(); }
  const_iterator cend() const { return end(); }
  reverse_iterator rbegin() { return reverse_iterator(end()); }
  reverse_iterator rend() { return reverse_iterator(begin()); }
  const_reverse_iterator rbegin() const { return const_reverse_iterator(end()); }
  const_reverse_iterator rend() const { return const_reverse_iterator(begin()); }

  T& operator[](size_t i) { return data_[i]; }
  const T& operator[](size_t i) const { return data_[i]; }
  T& at(size_t i) { return data_[checked(i)]; }
  const T& at(size_t i) const { return data_[checked(i)]; }
  T& front() { return data_[0]; }
  const T& front() const { return data_[0]; }
  T& back() { return data_[size_ - 1]; }
  const T& back() const { return data_[size_ - 1]; }

  void reserve(size_t n) {
    if (n > capacity_) grow_to(n);
  }
  void clear() { size_ = 0; }
  void push_back(const T& value) {
    const T copy = value;  // (value may be one of ours, which growing moves)
    if (size_ == capacity_) grow_to(2 * capacity_);
    data_[size_++] = copy;
  }
  template <typename... Args>
  T& emplace_back(Args&&... args) {
    push_back(T(std::forward<Args>(args)...));
    return back();
  }
  void pop_back() { --size_; }
  void resize(size_t n, const T& value = T()) {
    const T copy = value;
    if (n > size_) {
      reserve(n);
      std::fill(data_ + size_, data_ + n, copy);
    }
    size_ = n;
  }
  void assign(size_t n, const T& value) {
    const T copy = value;
    size_ = 0;
    reserve(n);
    std::fill_n(data_, n, copy);
    size_ = n;
  }
  template <std::input_iterator It>
  void assign(It first, It last) {
    if constexpr (std::contiguous_iterator<It>) {
      const auto n = static_cast<size_t>(last - first);
      if (n > capacity_) {
        InlineVector fresh;  // (the values may be ours: copied before ours go)
        fresh.grow_to(n);
        std::copy(first, last, fresh.data_);
        fresh.size_ = n;
        *this = std::move(fresh);
        return;
      }
      if (n > 0) std::memmove(data_, std::to_address(first), n * sizeof(T));  // (may overlap ours)
      size_ = n;
    } else {
      // Values read through any other iterator may be ours in any order:
      // gathered apart first.
      InlineVector fresh;
      for (; first != last; ++first) fresh.push_back(*first);
      *this = std::move(fresh);
    }
  }

  iterator insert(const_iterator pos, const T& value) { return insert(pos, 1, value); }
  iterator insert(const_iterator pos, size_t n, const T& value) {
    const size_t at = static_cast<size_t>(pos - data_);
    const T copy = value;
    open_gap(at, n);
    std::fill_n(data_ + at, n, copy);
    return data_ + at;
  }
  template <std::forward_iterator It>
  iterator insert(const_iterator pos, It first, It last) {
    const size_t at = static_cast<size_t>(pos - data_);
    const InlineVector values(first, last);  // (they may be ours)
    open_gap(at, values.size());
    std::copy(values.begin(), values.end(), data_ + at);
    return data_ + at;
  }
  iterator insert(const_iterator pos, std::initializer_list<T> values) {
    return insert(pos, values.begin(), values.end());
  }
  iterator erase(const_iterator pos) { return erase(pos, pos + 1); }
  iterator erase(const_iterator first, const_iterator last) {
    const size_t at = static_cast<size_t>(first - data_), n = static_cast<size_t>(last - first);
    std::memmove(data_ + at, data_ + at + n, (size_ - at - n) * sizeof(T));
    size_ -= n;
    return data_ + at;
  }
  void swap(InlineVector& other) noexcept {
    InlineVector held(std::move(other));
    other = std::move(*this);
    *this = std::move(held);
  }

  friend bool operator==(const InlineVector& a, const InlineVector& b) {
    return std::equal(a.begin(), a.end(), b.begin(), b.end());
  }
  friend auto operator<=>(const InlineVector& a, const InlineVector& b) {
    return std::lexicographical_compare_three_way(a.begin(), a.end(), b.begin(), b.end());
  }

 private:
  size_t checked(size_t i) const {
    if (i >= size_) throw std::out_of_range("InlineVector::at: index out of range");
    return i;
  }
  void grow_to(size_t n) {
    auto* p = static_cast<T*>(std::malloc(n * sizeof(T)));
    if (p == nullptr) throw std::bad_alloc();
    if (size_ > 0) std::memcpy(p, data_, size_ * sizeof(T));
    release();  // (keeps size_)
    data_ = p;
    capacity_ = n;
  }
  // n unset values at `at`, the ones from `at` on moved up.
  void open_gap(size_t at, size_t n) {
    if (size_ + n > capacity_) grow_to(std::max(size_ + n, 2 * capacity_));
    std::memmove(data_ + at + n, data_ + at, (size_ - at) * sizeof(T));
    size_ += n;
  }
  void release() {
    if (data_ != inline_) std::free(data_);
    data_ = inline_;
    capacity_ = N;
  }
  // Takes other's values (and its heap block, if any); other is left empty.
  void take(InlineVector& other) {
    if (other.data_ == other.inline_) {
      std::memcpy(inline_, other.inline_, other.size_ * sizeof(T));
    } else {
      data_ = other.data_;
      capacity_ = other.capacity_;
      other.data_ = other.inline_;
      other.capacity_ = N;
    }
    size_ = other.size_;
    other.size_ = 0;
  }

  T* data_ = inline_;
  size_t size_ = 0;
  size_t capacity_ = N;
  T inline_[N];
};

}  // namespace mpt
