//! Who asks for a pod, and whether they may restore into it (a SubjectAccessReview on
//! `podrestores`); pods of the built-in workload controllers need no review.

use super::*;

/// SubjectAccessReview: may this user create `podrestores.stasis.dev` in the namespace?
pub(crate) async fn may_restore(
    client: &Client,
    ns: &str,
    user: &k8s_openapi::api::authentication::v1::UserInfo,
) -> Result<bool> {
    let sar = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: user.username.clone(),
            groups: user.groups.clone(),
            uid: user.uid.clone(),
            extra: user.extra.clone(),
            resource_attributes: Some(ResourceAttributes {
                namespace: Some(ns.to_owned()),
                verb: Some("create".into()),
                group: Some(stasis_api::GROUP.into()),
                resource: Some("podrestores".into()),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    let answer = Api::<SubjectAccessReview>::all(client.clone())
        .create(&PostParams::default(), &sar)
        .await?;
    Ok(answer.status.is_some_and(|s| s.allowed))
}

/// The kind of the pod's controlling owner, if any.
pub fn controller_kind(pod: &Pod) -> Option<&str> {
    pod.metadata
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true))
        .map(|o| o.kind.as_str())
}

/// Classifies the requester without a SubjectAccessReview: `Some` when the answer does not
/// depend on one (the workload's own controller), `None` when the restore permission must be
/// asked for (then [`Requester::classify`] with the answer).
pub fn requester_without_review(user: &str, pod: &Pod) -> Option<Requester> {
    match Requester::classify(user, controller_kind(pod), false) {
        Requester::WorkloadController => Some(Requester::WorkloadController),
        Requester::Direct { .. } => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::pod;
    use serde_json::json;

    #[test]
    fn requesters() {
        let rs_pod = pod(json!({"metadata": {"ownerReferences": [
            {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "c-1", "uid": "u", "controller": true}
        ]}, "spec": {"containers": []}}));
        assert_eq!(
            requester_without_review(
                "system:serviceaccount:kube-system:replicaset-controller",
                &rs_pod
            ),
            Some(Requester::WorkloadController)
        );
        // The wrong controller for the owner kind, a person, an operator: ask.
        assert_eq!(
            requester_without_review("system:serviceaccount:kube-system:job-controller", &rs_pod),
            None
        );
        assert_eq!(requester_without_review("alice", &rs_pod), None);
        let bare = pod(json!({"spec": {"containers": []}}));
        assert_eq!(
            requester_without_review("system:kube-controller-manager", &bare),
            None
        );
    }
}
