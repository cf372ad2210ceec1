//! Which cluster pool serves requests that name none.
//!
//! Why explicit: pools are read back in etcd's key order, so taking the
//! first one read made adding pool `aaa` next to `pods` move every
//! request that names no pool to `aaa`. The default is recorded in etcd
//! (the `default_pool` key, outside `pools/` so older agents never read
//! it) by `cluster pools apply`: named with `default_pool`, or, when the
//! first apply stores a single pool, that pool. It changes only when an
//! apply names another one.

use super::ClusterError;
use super::spec::ClusterPoolSpec;

/// The default among `pools`, given what etcd records (`stored`): the
/// recorded pool; with none recorded (a set stored by an older version)
/// the only pool, if there is one. `Ok(None)` when there is no pool.
///
/// # Errors
/// [`ClusterError::NoDefault`] for several pools and none recorded,
/// [`ClusterError::DefaultUnknown`] for a recorded pool that is not
/// among them.
pub fn default_pool(
    pools: &[ClusterPoolSpec],
    stored: Option<&str>,
) -> Result<Option<String>, ClusterError> {
    match (stored, pools) {
        (Some(name), _) if pools.iter().any(|p| p.name == name) => Ok(Some(name.to_owned())),
        (Some(name), _) => Err(ClusterError::DefaultUnknown {
            pool: name.to_owned(),
        }),
        (None, []) => Ok(None),
        (None, [only]) => Ok(Some(only.name.clone())),
        (None, many) => Err(ClusterError::NoDefault {
            pools: many.iter().map(|p| p.name.clone()).collect(),
        }),
    }
}

/// The default an apply of `new` records, given the one etcd records
/// (`stored`) and the one the apply names (`asked`): `asked`, else
/// `stored`, else the only pool of `new`. Adding pools never moves it; an
/// apply replacing the set by a single pool makes that one the default
/// (there is no other to choose).
///
/// # Errors
/// [`ClusterError::DefaultUnknown`] (`asked` is not in `new`),
/// [`ClusterError::DefaultRemoved`] (`new` drops the stored default,
/// holds several pools and names none of them), [`ClusterError::NoDefault`]
/// (several pools, none named or stored).
pub fn default_for_apply(
    new: &[ClusterPoolSpec],
    stored: Option<&str>,
    asked: Option<&str>,
) -> Result<Option<String>, ClusterError> {
    if let Some(name) = asked {
        return default_pool(new, Some(name));
    }
    match stored {
        Some(name) if !new.iter().any(|p| p.name == name) => match new {
            [] => Ok(None),
            [only] => Ok(Some(only.name.clone())),
            _ => Err(ClusterError::DefaultRemoved {
                pool: name.to_owned(),
            }),
        },
        _ => default_pool(new, stored),
    }
}
