//! CUDA steps of a checkpoint (owned by the GPU work).
