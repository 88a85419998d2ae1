//! Sans-IO routing core: ART shard, residency, load view, scoring policies, ownership hashing.
