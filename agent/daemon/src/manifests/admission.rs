//! The admission policies that keep each agent's rights to what its node
//! must write (#44 item 8): RBAC grants every agent of a DaemonSet the
//! same verbs, so any node could patch any Service's status or any node's
//! NodeIPAM object. In modes `lb`, `pod-cidr` and `multi-pool` the writer
//! is the holder of the election's Lease; a `ValidatingAdmissionPolicy`
//! (GA since Kubernetes 1.30) lets through:
//! - the agent's writes of Service status and LoadBalancerIPPool objects
//!   only from the node the Lease names ([`POLICY`]);
//! - in mode `multi-pool`, its writes of a NodeIPAM object's spec only
//!   from the node of the object's name, and of its status only from that
//!   node with the offer (`status.pools`) unchanged, or from the writer,
//!   the operator ([`NODEIPAM_POLICY`]).
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

/// The NodeIPAM policy's name (the binding's too).
pub const NODEIPAM_POLICY: &str = "lockstep-nodeipam-own-node";

/// The node-name key of a pod-bound token's extra user info.
const NODE_NAME: &str = "authentication.kubernetes.io/node-name";

/// The policy and its binding for `o`'s mode, each with its heading
/// comment; none in modes without the Lease.
pub fn objects(o: &Options) -> Vec<(String, Value)> {
    if !o.mode.elects_on_a_lease() {
        return Vec::new();
    }
    let policy = policy(
        POLICY,
        o,
        json!([
            {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"],
             "resources": ["services/status"]},
            {"apiGroups": ["lockstep.io"], "apiVersions": ["*"], "operations": ["UPDATE"],
             "resources": ["loadbalancerippools", "loadbalancerippools/status"]},
        ]),
        format!(
            "'{NODE_NAME}' in request.userInfo.extra && \
             has(params.spec.holderIdentity) && \
             params.spec.holderIdentity == request.userInfo.extra['{NODE_NAME}'][0]"
        ),
        format!(
            "'only the LB writer (the node holding Lease ' + params.metadata.name + \
             ') writes LoadBalancer state; this request came from node ' + {FROM}"
        ),
    );
    let mut out = vec![
        (
            "Only the LB writer writes LoadBalancer state: the agent's writes of Service\n\
             status and LoadBalancerIPPool objects are let through only from the node\n\
             holding the election's Lease (docs/kubernetes.md, \"RBAC, and why\").\n\
             Needs Kubernetes 1.30 or later (pod-bound tokens carry the node's name)."
                .into(),
            policy,
        ),
        (String::new(), binding(POLICY, o)),
    ];
    if o.mode == Mode::MultiPool {
        out.push((
            "Each node writes only its own NodeIPAM object, and never the offer in its\n\
             status: that is the LB writer's, the NodeIPAM operator (docs/kubernetes.md,\n\
             \"RBAC, and why\"). Needs Kubernetes 1.30 or later."
                .into(),
            nodeipam_policy(o),
        ));
        out.push((String::new(), binding(NODEIPAM_POLICY, o)));
    }
    out
}

/// The binding of policy `name` to the election's Lease.
fn binding(name: &str, o: &Options) -> Value {
    json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "lockstep"}},
        "spec": {
            "policyName": name,
            "validationActions": ["Deny"],
            "paramRef": {
                "name": crate::config::ElectionConfig::default().name,
                "namespace": o.namespace,
                "parameterNotFoundAction": "Deny",
            },
        },
    })
}

/// The CEL of the NodeIPAM policy: the request's node, whether it is the
/// writer, and what each may write.
pub fn nodeipam_expression() -> String {
    let node = format!("request.userInfo.extra['{NODE_NAME}'][0]");
    let offer_kept = "(has(object.status) && has(object.status.pools) ?          (has(oldObject.status) && has(oldObject.status.pools) &&           object.status.pools == oldObject.status.pools) :          !(has(oldObject.status) && has(oldObject.status.pools)))";
    format!(
        "'{NODE_NAME}' in request.userInfo.extra &&          (request.subResource != 'status' ? object.metadata.name == {node} :           ((has(params.spec.holderIdentity) && params.spec.holderIdentity == {node}) ||            (object.metadata.name == {node} && {offer_kept})))"
    )
}

fn nodeipam_policy(o: &Options) -> Value {
    policy(
        NODEIPAM_POLICY,
        o,
        json!([
            {"apiGroups": ["lockstep.io"], "apiVersions": ["*"],
             "operations": ["CREATE", "UPDATE"],
             "resources": ["nodeipams", "nodeipams/status"]},
        ]),
        nodeipam_expression(),
        format!(
            "'a node writes only its own NodeIPAM object, and only the LB writer (the node \
             holding Lease ' + params.metadata.name + ') writes offers; this request came \
             from node ' + {FROM} + ' for ' + object.metadata.name"
        ),
    )
}

/// The CEL naming the request's node, for messages.
const FROM: &str = "('authentication.kubernetes.io/node-name' in request.userInfo.extra ? \
     request.userInfo.extra['authentication.kubernetes.io/node-name'][0] : 'unknown')";

/// A policy `name` on the agent's requests matching `rules`, with the
/// election's Lease as its parameter: `expression` must hold, else the
/// request is refused with `message` (a CEL expression).
fn policy(name: &str, o: &Options, rules: Value, expression: String, message: String) -> Value {
    let agent = format!("system:serviceaccount:{}:lockstep", o.namespace);
    json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "lockstep"}},
        "spec": {
            "failurePolicy": "Fail",
            "paramKind": {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease"},
            "matchConstraints": {"resourceRules": rules},
            "matchConditions": [{
                "name": "the-lockstep-agent",
                "expression": format!("request.userInfo.username == '{agent}'"),
            }],
            "validations": [{
                "expression": expression,
                "messageExpression": message,
                "reason": "Forbidden",
            }],
        },
    })
}

#[cfg(test)]
mod tests {
    //! The policies' CEL evaluated by a CEL interpreter against the
    //! requests the API server would hand them: the API double runs no
    //! admission, so this is where the rules themselves are checked.
    use super::*;

    const NODE_KEY: &str = NODE_NAME;

    /// The policy `p`'s first validation on a request from `node` (`None`:
    /// a token without a node) writing `object` over `old` (its
    /// `subresource`), with the Lease held by `holder`.
    fn admits(
        p: &Value,
        node: Option<&str>,
        subresource: &str,
        object: &Value,
        old: &Value,
        holder: &str,
    ) -> bool {
        let expr = p["spec"]["validations"][0]["expression"].as_str().unwrap();
        let program = cel::Program::compile(expr).unwrap();
        let mut ctx = cel::Context::default();
        let extra = node.map_or(json!({}), |n| json!({NODE_KEY: [n]}));
        ctx.add_variable(
            "request",
            json!({"userInfo": {"username": "system:serviceaccount:kube-system:lockstep", "extra": extra},
                   "subResource": subresource}),
        )
        .unwrap();
        ctx.add_variable("object", object.clone()).unwrap();
        ctx.add_variable("oldObject", old.clone()).unwrap();
        ctx.add_variable(
            "params",
            json!({"metadata": {"name": "lockstep-lb-writer"}, "spec": {"holderIdentity": holder}}),
        )
        .unwrap();
        // The refusal's message is CEL too: it must give a string.
        let message = p["spec"]["validations"][0]["messageExpression"]
            .as_str()
            .unwrap();
        match cel::Program::compile(message).unwrap().execute(&ctx) {
            Ok(cel::Value::String(m)) => assert!(m.contains("this request came from node")),
            other => panic!("{message}: {other:?}"),
        }
        match program.execute(&ctx) {
            Ok(cel::Value::Bool(b)) => b,
            other => panic!("{expr}: {other:?}"),
        }
    }

    fn options(mode: Mode) -> Options {
        Options {
            mode,
            namespace: "kube-system".into(),
            image: "lockstep:test".into(),
            uplink: "eth0".into(),
            metrics_addr: "0.0.0.0:9476".parse().unwrap(),
            pools: vec![],
            lb_pools: vec![],
            non_masquerade: vec![],
            etcd: vec![],
            etcd_tls_secret: None,
            lb_class: "lockstep.io/lb".into(),
            serve_classless: true,
            conflist_name: "05-lockstep.conflist".into(),
            service_monitor: false,
            bgp: None,
        }
    }

    fn policy(mode: Mode, name: &str) -> Value {
        objects(&options(mode))
            .into_iter()
            .map(|(_, v)| v)
            .find(|v| v["kind"] == "ValidatingAdmissionPolicy" && v["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("no policy {name} in mode {mode:?}"))
    }

    fn nodeipam(name: &str, offer: Option<Value>, conditions: Value) -> Value {
        let mut status = json!({"conditions": conditions});
        if let Some(o) = offer {
            status["pools"] = o;
        }
        json!({"metadata": {"name": name}, "spec": {"pools": [{"name": "default", "requested": 3}]},
               "status": status})
    }

    #[test]
    fn a_node_writes_its_own_nodeipam_and_only_the_writer_writes_offers() {
        let p = policy(Mode::MultiPool, NODEIPAM_POLICY);
        let offer = json!([{"name": "default", "ipv4": ["10.0.0.0/28"]}]);
        let other = json!([{"name": "default", "ipv4": ["10.0.0.16/28"]}]);
        let mine = nodeipam("node-a", Some(offer.clone()), json!([]));
        let null = Value::Null;
        // The spec: its own node's only, writer or not.
        assert!(admits(&p, Some("node-a"), "", &mine, &null, "node-w"));
        assert!(!admits(&p, Some("node-b"), "", &mine, &null, "node-w"));
        assert!(!admits(&p, Some("node-w"), "", &mine, &mine, "node-w"));
        // The status: its own conditions, the offer unchanged...
        let conds = nodeipam("node-a", Some(offer.clone()), json!([{"type": "Accepted"}]));
        assert!(admits(
            &p,
            Some("node-a"),
            "status",
            &conds,
            &mine,
            "node-w"
        ));
        let none = nodeipam("node-a", None, json!([]));
        let none_conds = nodeipam("node-a", None, json!([{"type": "Accepted"}]));
        assert!(admits(
            &p,
            Some("node-a"),
            "status",
            &none_conds,
            &none,
            "node-w"
        ));
        // ...never an offer of its own making, nor another node's status.
        let grabbed = nodeipam("node-a", Some(other.clone()), json!([]));
        assert!(!admits(
            &p,
            Some("node-a"),
            "status",
            &grabbed,
            &mine,
            "node-w"
        ));
        assert!(!admits(
            &p,
            Some("node-a"),
            "status",
            &mine,
            &none,
            "node-w"
        ));
        assert!(!admits(
            &p,
            Some("node-b"),
            "status",
            &conds,
            &mine,
            "node-w"
        ));
        // The writer writes any node's offer; a token without a node nothing.
        assert!(admits(
            &p,
            Some("node-w"),
            "status",
            &grabbed,
            &mine,
            "node-w"
        ));
        assert!(admits(
            &p,
            Some("node-a"),
            "status",
            &grabbed,
            &mine,
            "node-a"
        ));
        assert!(!admits(&p, None, "status", &conds, &mine, "node-w"));
        assert!(!admits(&p, None, "", &mine, &null, "node-w"));
    }

    #[test]
    fn lb_state_is_written_only_from_the_leases_holder() {
        for mode in [Mode::Lb, Mode::PodCidr, Mode::MultiPool] {
            let p = policy(mode, POLICY);
            let svc = json!({"metadata": {"name": "web"}});
            assert!(admits(&p, Some("node-w"), "status", &svc, &svc, "node-w"));
            assert!(!admits(&p, Some("node-a"), "status", &svc, &svc, "node-w"));
            assert!(!admits(&p, None, "status", &svc, &svc, "node-w"));
        }
        assert!(objects(&options(Mode::Cluster)).is_empty());
        assert!(
            !objects(&options(Mode::PodCidr))
                .iter()
                .any(|(_, v)| v["metadata"]["name"] == NODEIPAM_POLICY)
        );
    }
}
