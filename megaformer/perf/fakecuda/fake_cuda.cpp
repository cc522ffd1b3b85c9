// Fake CUDA for a CPU-only torch: lets tensors on device "cuda" exist under FakeTensorMode (no
// storage, no kernels) and go through autograd, as they would on one GPU.
//
// Two registrations, loaded before `import torch` (LD_PRELOAD; after the import is too late, since
// c10 looks the hooks up once) — see ../shared/docs/FACTS-FAKE-CUDA.md:
//  * c10's FakeGuardImpl as the CUDA device guard: autograd's InputMetadata asks the guard of every
//    tensor's device; without one the first CUDA op that records autograd aborts the process.
//  * a CUDAHooksInterface reporting one built, available device (no-op init), so that the
//    accelerator checks of autograd, SDPA, fused AdamW and dropout pass.
// Nothing here runs a kernel: every tensor must be a FakeTensor (FakeTensorMode), or the op fails.
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

namespace at {
namespace {

struct FakeCUDAHooks final : CUDAHooksInterface {
  explicit FakeCUDAHooks(CUDAHooksArgs) {}
  void init() const override {}
  bool hasCUDA() const override { return true; }
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  DeviceIndex deviceCount() const override { return 1; }
  DeviceIndex current_device() const override { return 0; }
  DeviceIndex getCurrentDevice() const override { return 0; }
  int getNumGPUs() const override { return 1; }
  void setCurrentDevice(DeviceIndex) const override {}
  DeviceIndex exchangeDevice(DeviceIndex) const override { return 0; }
  DeviceIndex maybeExchangeDevice(DeviceIndex) const override { return 0; }
  void deviceSynchronize(DeviceIndex) const override {}
};

}  // namespace

// c10 asks the registry for the key "CUDAHooks" (what libtorch_cuda registers in a CUDA build).
C10_REGISTER_CLASS(CUDAHooksRegistry, CUDAHooks, FakeCUDAHooks);
}  // namespace at

C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>);
