//! The admission policy that keeps the LB writer's rights to the writer
//! (#44 item 8): RBAC grants every agent of a DaemonSet the same verbs, so
//! any node could patch any Service's status. In modes `lb` and `pod-cidr`
//! the writer is the holder of the election's Lease; a
//! `ValidatingAdmissionPolicy` (GA since Kubernetes 1.30) lets through the
//! agent's writes of Service status and LoadBalancerIPPool objects only
//! from the node the Lease names.
//!
//! The node of a request is the one its service account token is bound to:
//! `request.userInfo.extra["authentication.kubernetes.io/node-name"]`, set
//! for pod-bound tokens since Kubernetes 1.30 (beta, on by default; GA in
//! 1.32). Cluster mode elects its writer in etcd, which an admission
//! policy cannot read: no policy there.

use serde_json::{Value, json};

use super::{Mode, Options};

/// The policy's name (the binding's too).
pub const POLICY: &str = "lockstep-lb-writer-only";

/// The node-name key of a pod-bound token's extra user info.
const NODE_NAME: &str = "authentication.kubernetes.io/node-name";

/// The policy and its binding for `o`'s mode, each with its heading
/// comment; none in modes without the Lease.
pub fn objects(o: &Options) -> Vec<(String, Value)> {
    if !matches!(o.mode, Mode::Lb | Mode::PodCidr) {
        return Vec::new();
    }
    let agent = format!("system:serviceaccount:{}:lockstep", o.namespace);
    let policy = json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": POLICY, "labels": {"app.kubernetes.io/name": "lockstep"}},
        "spec": {
            "failurePolicy": "Fail",
            "paramKind": {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease"},
            "matchConstraints": {"resourceRules": [
                {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"],
                 "resources": ["services/status"]},
                {"apiGroups": ["lockstep.io"], "apiVersions": ["*"], "operations": ["UPDATE"],
                 "resources": ["loadbalancerippools", "loadbalancerippools/status"]},
            ]},
            "matchConditions": [{
                "name": "the-lockstep-agent",
                "expression": format!("request.userInfo.username == '{agent}'"),
            }],
            "validations": [{
                "expression": format!(
                    "'{NODE_NAME}' in request.userInfo.extra && \
                     has(params.spec.holderIdentity) && \
                     params.spec.holderIdentity == request.userInfo.extra['{NODE_NAME}'][0]"
                ),
                "messageExpression": format!(
                    "'only the LB writer (the node holding Lease ' + params.metadata.name + \
                     ') writes LoadBalancer state; this request came from node ' + \
                     ('{NODE_NAME}' in request.userInfo.extra ? request.userInfo.extra['{NODE_NAME}'][0] : 'unknown')"
                ),
                "reason": "Forbidden",
            }],
        },
    });
    let binding = json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": POLICY, "labels": {"app.kubernetes.io/name": "lockstep"}},
        "spec": {
            "policyName": POLICY,
            "validationActions": ["Deny"],
            "paramRef": {
                "name": crate::config::ElectionConfig::default().name,
                "namespace": o.namespace,
                "parameterNotFoundAction": "Deny",
            },
        },
    });
    vec![
        (
            "Only the LB writer writes LoadBalancer state: the agent's writes of Service\n\
             status and LoadBalancerIPPool objects are let through only from the node\n\
             holding the election's Lease (docs/kubernetes.md, \"RBAC, and why\").\n\
             Needs Kubernetes 1.30 or later (pod-bound tokens carry the node's name)."
                .into(),
            policy,
        ),
        (String::new(), binding),
    ]
}
