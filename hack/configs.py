"""What the embedded cluster's components read from .cluster/: the PKI (openssl CLI), the kubeconfigs, each
component's config file, the CNI network, the audit policy, and the RBAC the API server is given at start."""
from __future__ import annotations

import base64
import json
import os
import textwrap
from pathlib import Path

from hack.common import (API_URL, BRIDGE, CLUSTER_DOMAIN, CNI_NETWORK, CONF, CONTAINERD_SOCK, KUBECONFIG,
                         KUBERNETES_SERVICE_IP, NODE_IP, NODE_NAME, PAUSE_IMAGE, PKI, POD_CIDR, REGISTRY_HOSTS_DIR,
                         containerd_config, run, write)


# --------------------------------------------------------------------------------------------
# PKI and kubeconfigs (openssl CLI; EC keys are quick to make)

def _cert(name: str, cn: str, orgs: tuple[str, ...] = (), sans: tuple[str, ...] = ()) -> None:
    key, crt = PKI / f"{name}.key", PKI / f"{name}.crt"
    if crt.exists() and key.exists():
        return
    subj = "".join(f"/O={o}" for o in orgs) + f"/CN={cn}"
    ext = ["basicConstraints=critical,CA:FALSE", "keyUsage=critical,digitalSignature,keyEncipherment",
           "extendedKeyUsage=serverAuth,clientAuth"]
    if sans:
        ext.append("subjectAltName=" + ",".join(sans))
    extfile = write(PKI / f"{name}.ext", "\n".join(ext) + "\n")
    run(["openssl", "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(key)])
    csr = run(["openssl", "req", "-new", "-key", str(key), "-subj", subj]).stdout
    run(["openssl", "x509", "-req", "-CA", str(PKI / "ca.crt"), "-CAkey", str(PKI / "ca.key"),
         "-set_serial", str(int.from_bytes(os.urandom(8), "big")), "-days", "3650", "-extfile", str(extfile),
         "-out", str(crt)], input=csr)
    extfile.unlink()
    key.chmod(0o600)


def ensure_pki() -> None:
    PKI.mkdir(parents=True, exist_ok=True)
    if not (PKI / "ca.crt").exists():
        run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", str(PKI / "ca.key"), "-out", str(PKI / "ca.crt"), "-days", "3650",
             "-subj", "/CN=ddpjob-cluster-ca", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature"])
    if not (PKI / "sa.key").exists():  # service-account token signing key (RS256, the common choice)
        run(["openssl", "genrsa", "-out", str(PKI / "sa.key"), "2048"])
        run(["openssl", "rsa", "-in", str(PKI / "sa.key"), "-pubout", "-out", str(PKI / "sa.pub")])
    sans = ("DNS:kubernetes", "DNS:kubernetes.default", "DNS:kubernetes.default.svc",
            f"DNS:kubernetes.default.svc.{CLUSTER_DOMAIN}", "DNS:localhost", "IP:127.0.0.1", f"IP:{NODE_IP}",
            f"IP:{KUBERNETES_SERVICE_IP}")
    _cert("apiserver", "kube-apiserver", sans=sans)
    # Client identities, each the user name the built-in RBAC bindings expect.
    _cert("admin", "kubernetes-admin", orgs=("system:masters",))
    _cert("apiserver-kubelet-client", "kube-apiserver-kubelet-client", orgs=("system:masters",))
    _cert("controller-manager", "system:kube-controller-manager")
    _cert("scheduler", "system:kube-scheduler")
    _cert("kube-proxy", "system:kube-proxy")
    _cert("coredns", "system:coredns")  # bound to a ClusterRole in bootstrap_rbac()
    _cert("kube-router", "system:kube-router")  # likewise
    _cert(f"node-{NODE_NAME}", f"system:node:{NODE_NAME}", orgs=("system:nodes",), sans=(f"IP:{NODE_IP}",))


def kubeconfig_text(user: str, cert: str) -> str:
    b64 = lambda p: base64.b64encode((PKI / p).read_bytes()).decode()  # noqa: E731
    return textwrap.dedent(f"""\
        apiVersion: v1
        kind: Config
        clusters:
        - name: ddpjob
          cluster:
            server: {API_URL}
            certificate-authority-data: {b64("ca.crt")}
        users:
        - name: {user}
          user:
            client-certificate-data: {b64(cert + ".crt")}
            client-key-data: {b64(cert + ".key")}
        contexts:
        - name: ddpjob
          context: {{cluster: ddpjob, user: {user}, namespace: default}}
        current-context: ddpjob
        """)


def _restricted_oom_score() -> bool:
    """True when this root cannot lower an oom_score_adj (no CAP_SYS_RESOURCE, as on our VMs)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return not int(line.split()[1], 16) & (1 << 24)  # CAP_SYS_RESOURCE
    return False


def write_configs() -> None:
    """Write every kubeconfig and component config; cheap and deterministic, so done on each `up`."""
    ensure_pki()
    write(KUBECONFIG, kubeconfig_text("admin", "admin"), 0o600)
    for name, cert in [("controller-manager", "controller-manager"), ("scheduler", "scheduler"),
                       ("kube-proxy", "kube-proxy"), ("coredns", "coredns"), ("kube-router", "kube-router"),
                       ("kubelet", f"node-{NODE_NAME}")]:
        write(CONF / f"{name}.kubeconfig", kubeconfig_text(name, cert), 0o600)

    # Audit: metadata of every write (who changed what, when); reads are too chatty to keep.
    # The operator's API-load benchmark reads this file.
    write(CONF / "audit-policy.yaml", textwrap.dedent("""\
        apiVersion: audit.k8s.io/v1
        kind: Policy
        omitStages: [RequestReceived]
        rules:
        - level: None
          verbs: [get, list, watch]
        - level: Metadata
        """))

    write(CONF / "containerd.toml", containerd_config(PAUSE_IMAGE, CONF / "cni", systemd_cgroup=False,
                                                      restrict_oom_score_adj=_restricted_oom_score(), private=True,
                                                      registry_hosts=REGISTRY_HOSTS_DIR))

    # One bridge network; the bridge IP is the pods' gateway, DNS server and API endpoint.
    write(CONF / "cni" / "10-ddpjob.conflist", json.dumps({
        "cniVersion": "1.0.0",
        "name": CNI_NETWORK,
        "plugins": [
            {"type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": True, "hairpinMode": True,
             "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_CIDR, "gateway": NODE_IP}]],
                      "routes": [{"dst": "0.0.0.0/0"}]}},
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }, indent=2) + "\n")

    write(CONF / "kube-scheduler.yaml", textwrap.dedent(f"""\
        apiVersion: kubescheduler.config.k8s.io/v1
        kind: KubeSchedulerConfiguration
        clientConnection:
          kubeconfig: {CONF / 'scheduler.kubeconfig'}
        leaderElection:
          leaderElect: false
        """))

    write(CONF / "kubelet.yaml", textwrap.dedent(f"""\
        apiVersion: kubelet.config.k8s.io/v1beta1
        kind: KubeletConfiguration
        address: {NODE_IP}
        port: 10250
        readOnlyPort: 0
        healthzBindAddress: 127.0.0.1
        healthzPort: 10248
        authentication:
          anonymous: {{enabled: false}}
          webhook: {{enabled: true}}
          x509: {{clientCAFile: {PKI / 'ca.crt'}}}
        authorization:
          mode: Webhook
        containerRuntimeEndpoint: unix://{CONTAINERD_SOCK}
        cgroupDriver: cgroupfs          # no systemd on these machines; containerd uses cgroupfs too
        failSwapOn: false
        failCgroupV1: false             # the machines are cgroup v1
        clusterDNS: [{NODE_IP}]         # CoreDNS runs on the host, on the bridge address
        clusterDomain: {CLUSTER_DOMAIN}
        # The pause and local images cannot be pulled again: never garbage-collect images.
        imageGCHighThresholdPercent: 100
        imageGCLowThresholdPercent: 99
        # No eviction for disk (0% switches a signal off, as kind does): under disk pressure the kubelet taints the
        # node (nothing schedules) and its image GC deletes every unused image, pause and the localhost/ images too,
        # which no registry can give back. A full disk fails the commands that fill it instead, with their message.
        evictionHard:
          memory.available: 100Mi
          nodefs.available: "0%"
          nodefs.inodesFree: "0%"
          imagefs.available: "0%"
          imagefs.inodesFree: "0%"
        serializeImagePulls: false
        # A lost node is noticed in about 20 s instead of 50 s, as on our kind clusters: the node Lease is renewed
        # every 5 s (a quarter of its duration) and the controller manager's node-monitor-grace-period is 20 s.
        nodeLeaseDurationSeconds: 20
        rotateCertificates: false
        serverTLSBootstrap: false
        maxPods: 110
        """))

    write(CONF / "kube-proxy.yaml", textwrap.dedent(f"""\
        apiVersion: kubeproxy.config.k8s.io/v1alpha1
        kind: KubeProxyConfiguration
        mode: iptables
        clientConnection:
          kubeconfig: {CONF / 'kube-proxy.kubeconfig'}
        hostnameOverride: {NODE_NAME}
        clusterCIDR: {POD_CIDR}
        healthzBindAddress: 127.0.0.1:10256
        metricsBindAddress: 127.0.0.1:10249
        nodePortAddresses: ["{NODE_IP}/32"]   # never expose NodePorts on the host's real interfaces
        iptables:
          localhostNodePorts: false          # would flip route_localnet on the host
        conntrack:                           # leave the host's conntrack sysctls alone
          maxPerCore: 0
          min: 0
          tcpEstablishedTimeout: 0s
          tcpCloseWaitTimeout: 0s
        """))

    # CoreDNS: only cluster.local and reverse zones, short TTLs so a replaced pod is found quickly;
    # no forwarding (pods in tests need no outside names).
    write(CONF / "Corefile", textwrap.dedent(f"""\
        {CLUSTER_DOMAIN}:53 in-addr.arpa:53 ip6.arpa:53 {{
            bind {NODE_IP}
            errors
            kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
                kubeconfig {CONF / 'coredns.kubeconfig'}
                pods insecure
                ttl 5
            }}
            cache 5
        }}
        """))


BOOTSTRAP_RBAC = """\
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "ddpjob:coredns"}
rules:
- apiGroups: [""]
  resources: [endpoints, services, pods, namespaces]
  verbs: [list, watch]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "ddpjob:coredns"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "ddpjob:coredns"}
subjects:
- {apiGroup: rbac.authorization.k8s.io, kind: User, name: "system:coredns"}
---
# kube-router's informers (it starts them all, whichever controllers run) and its own Node.
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "ddpjob:kube-router"}
rules:
- apiGroups: [""]
  resources: [pods, namespaces, nodes, services, endpoints]
  verbs: [get, list, watch]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [list, watch]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "ddpjob:kube-router"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "ddpjob:kube-router"}
subjects:
- {apiGroup: rbac.authorization.k8s.io, kind: User, name: "system:kube-router"}
"""
