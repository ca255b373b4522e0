#pragma once
// A string-keyed map that remembers insertion order. Parameter names, state
// dicts and optimizer state are walked in registration order (that order is
// what makes checkpoints, gradient buckets and printed summaries stable), so
// std::map's sorted order would be wrong and std::unordered_map's arbitrary.
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tensor/error.h"

namespace mpt {

template <typename V>
class OrderedDict {
 public:
  using Item = std::pair<std::string, V>;
  using iterator = typename std::vector<Item>::iterator;
  using const_iterator = typename std::vector<Item>::const_iterator;

  OrderedDict() = default;
  OrderedDict(std::initializer_list<Item> items) {
    for (const Item& it : items) insert(it.first, it.second);
  }

  // Adds a new key at the end; a key that is already present is an error
  // (two parameters with one name would silently shadow each other).
  V& insert(std::string key, V value) {
    check(!contains(key), "OrderedDict: duplicate key '{}'", key);
    index_.emplace(key, items_.size());
    items_.emplace_back(std::move(key), std::move(value));
    return items_.back().second;
  }
  // Replaces the value of an existing key in place, or appends a new one.
  V& insert_or_assign(std::string key, V value) {
    if (V* v = find(key)) return *v = std::move(value);
    return insert(std::move(key), std::move(value));
  }

  bool contains(const std::string& key) const { return index_.count(key) != 0; }
  V* find(const std::string& key) {
    auto it = index_.find(key);
    return it == index_.end() ? nullptr : &items_[it->second].second;
  }
  const V* find(const std::string& key) const {
    auto it = index_.find(key);
    return it == index_.end() ? nullptr : &items_[it->second].second;
  }
  V& at(const std::string& key) {
    V* v = find(key);
    check(v != nullptr, "OrderedDict: no key '{}'", key);
    return *v;
  }
  const V& at(const std::string& key) const {
    const V* v = find(key);
    check(v != nullptr, "OrderedDict: no key '{}'", key);
    return *v;
  }

  std::vector<std::string> keys() const {
    std::vector<std::string> out;
    out.reserve(items_.size());
    for (const Item& it : items_) out.push_back(it.first);
    return out;
  }
  std::vector<V> values() const {
    std::vector<V> out;
    out.reserve(items_.size());
    for (const Item& it : items_) out.push_back(it.second);
    return out;
  }

  size_t size() const { return items_.size(); }
  bool empty() const { return items_.empty(); }
  void clear() {
    items_.clear();
    index_.clear();
  }
  const Item& operator[](size_t i) const { return items_.at(i); }
  Item& operator[](size_t i) { return items_.at(i); }

  iterator begin() { return items_.begin(); }
  iterator end() { return items_.end(); }
  const_iterator begin() const { return items_.begin(); }
  const_iterator end() const { return items_.end(); }

 private:
  std::vector<Item> items_;
  std::unordered_map<std::string, size_t> index_;
};

}  // namespace mpt
