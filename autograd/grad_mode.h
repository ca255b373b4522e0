#pragma once
// Whether ops record autograd history, per thread (on by default).
namespace mpt {

bool grad_enabled();
void set_grad_enabled(bool on);

// Turns recording off for a scope (evaluation, optimizer updates).
class NoGradGuard {
 public:
  NoGradGuard() : previous_(grad_enabled()) { set_grad_enabled(false); }
  ~NoGradGuard() { set_grad_enabled(previous_); }
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool previous_;
};

}  // namespace mpt
