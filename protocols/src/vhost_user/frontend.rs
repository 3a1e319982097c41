//! vhost-user frontend: the VMM side of a vhost-user-blk device.
