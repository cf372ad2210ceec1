//! The agent's side of leak detection (#29 item 3): which endpoint
//! attachments can be judged against the Kubernetes API, and the release of
//! one the door found leaked.
//!
//! Apart from CNI GC because the judge differs: GC trusts the runtime's
//! list of attachments, this trusts the API's pods, and only ever touches
//! an attachment recorded with the pod it was made for.

use lockstep_core::pods::PodRef;

use super::{Agent, AgentError};
use crate::store::endpoint_key;

impl Agent {
    /// Endpoint attachments made for a Kubernetes pod (record key, pod):
    /// the ones leak detection judges. Delegated attachments and ones being
    /// released are left out; agent-role and LoadBalancer addresses are not
    /// endpoint attachments.
    pub fn pod_endpoints(&self) -> Vec<(String, PodRef)> {
        self.endpoints
            .iter()
            .filter(|(key, r)| !r.releasing && !self.delegated.contains_key(*key))
            .filter_map(|(key, r)| r.pod.clone().map(|p| (key.clone(), p)))
            .collect()
    }

    /// Releases the attachment `key` as leaked by `pod`, as a DEL would,
    /// only while its record still names that pod (an ADD since may have
    /// reused the attachment). Returns whether it released anything.
    ///
    /// # Errors
    /// As a DEL.
    pub fn release_leaked(&mut self, key: &str, pod: &PodRef) -> Result<bool, AgentError> {
        self.check_ready()?;
        let Some(r) = self.endpoints.get(key) else {
            return Ok(false);
        };
        if r.pod.as_ref() != Some(pod) || r.releasing || self.delegated.contains_key(key) {
            return Ok(false);
        }
        let (container_id, ifname) = (r.container_id.clone(), r.ifname.clone());
        debug_assert_eq!(endpoint_key(&container_id, &ifname), key);
        tracing::warn!(
            pod = %pod,
            container_id = %container_id,
            ifname = %ifname,
            "releasing a leaked endpoint allocation: its pod is gone"
        );
        self.endpoint_del_inner(&container_id, &ifname)?;
        Ok(true)
    }
}
