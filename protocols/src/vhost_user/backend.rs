//! vhost-user-blk backend: iopath's virtio-blk queues served in a device process.
