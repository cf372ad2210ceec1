//! The mirror's own reads of etcd: everything under the prefix in pages
//! at one revision (a first start, a compaction, a restore), where a
//! copy's watch must reach to be etcd's state (a restart), and the raw
//! watch itself. Every other read of an agent's cluster tasks comes from
//! the mirror.

use etcd_client::{GetOptions, SortOrder, SortTarget, WatchOptions};
use lockstep_core::cluster::StoreMark;

use super::Kv;
use crate::cluster::{ClusterStoreError, Door};

impl Door {
    /// Every key under the prefix at one revision, read in pages of
    /// `page` keys (one answer for the whole cluster passed gRPC's 4 MiB
    /// limit at a few thousand nodes), and the store mark of the read.
    ///
    /// # Errors
    /// etcd unavailable, or the history compacted between two pages (read
    /// again).
    pub(super) async fn read_everything(
        &self,
        page: i64,
    ) -> Result<(Vec<Kv>, StoreMark), ClusterStoreError> {
        let prefix = self.options().prefix.clone();
        let end = prefix_end(&prefix);
        let mut out = Vec::new();
        let mut at = 0;
        let mut mark = StoreMark::default();
        let mut from = prefix.clone().into_bytes();
        loop {
            let resp = self
                .retrying("read everything", false, |mut c| {
                    let from = from.clone();
                    let end = end.clone();
                    async move {
                        let mut o = GetOptions::new().with_range(end).with_limit(page);
                        if at > 0 {
                            o = o.with_revision(at);
                        }
                        c.get(from, Some(o)).await
                    }
                })
                .await?;
            if let Some(h) = resp.header()
                && at == 0
            {
                at = h.revision();
                mark = StoreMark {
                    cluster_id: h.cluster_id(),
                    revision: h.revision(),
                };
            }
            out.extend(resp.kvs().iter().map(Kv::of));
            match resp.kvs().last() {
                Some(last) if resp.more() => {
                    from = last.key().to_vec();
                    from.push(0);
                }
                _ => break,
            }
        }
        Ok((out, mark))
    }

    /// What a mirror exact at revision `since` must reach to be etcd's
    /// state at revision `at` (a watch made at `at` catching up from
    /// `since`): the highest mod revision of the keys changed after
    /// `since` that exist at `at` (`since` when none), and how many keys
    /// the prefix holds at `at`. Two reads that send a key and a count,
    /// not the prefix.
    ///
    /// # Errors
    /// etcd unavailable, or `at` compacted.
    pub(super) async fn caught_up_at(
        &self,
        since: i64,
        at: i64,
    ) -> Result<(i64, usize), ClusterStoreError> {
        let prefix = self.options().prefix.clone();
        let end = prefix_end(&prefix);
        let last = self
            .retrying("read the last change", false, |mut c| {
                let (prefix, end) = (prefix.clone(), end.clone());
                async move {
                    let o = GetOptions::new()
                        .with_range(end)
                        .with_revision(at)
                        .with_min_mod_revision(since + 1)
                        .with_keys_only()
                        .with_sort(SortTarget::Mod, SortOrder::Descend)
                        .with_limit(1);
                    c.get(prefix, Some(o)).await
                }
            })
            .await?;
        let count = self
            .retrying("count the keys", false, |mut c| {
                let (prefix, end) = (prefix.clone(), end.clone());
                async move {
                    let o = GetOptions::new()
                        .with_range(end)
                        .with_revision(at)
                        .with_count_only();
                    c.get(prefix, Some(o)).await
                }
            })
            .await?;
        Ok((
            last.kvs()
                .first()
                .map_or(since, etcd_client::KeyValue::mod_revision),
            usize::try_from(count.count()).unwrap_or(usize::MAX),
        ))
    }

    /// A raw watch of every key under the prefix from `from` (inclusive),
    /// started one revision earlier (see [`Door::watch`]: a compaction at
    /// exactly `from` is then refused, not silently skipped).
    pub(in crate::cluster) async fn watch_raw(
        &self,
        from: i64,
    ) -> Result<etcd_client::WatchStream, ClusterStoreError> {
        let prefix = self.options().prefix.clone();
        let start = if from > 1 { from - 1 } else { from };
        self.retrying("watch", false, |mut c| {
            let prefix = prefix.clone();
            async move {
                let options = WatchOptions::new()
                    .with_prefix()
                    .with_start_revision(start)
                    .with_progress_notify();
                c.watch(prefix, Some(options)).await
            }
        })
        .await
    }
}

/// The end of the range of keys starting with `prefix`.
fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_range_end_of_a_prefix_covers_it_and_nothing_after() {
        assert_eq!(prefix_end("/lockstep/v1/"), b"/lockstep/v10".to_vec());
        assert_eq!(prefix_end("a\u{7f}"), b"a\x80".to_vec());
    }
}
