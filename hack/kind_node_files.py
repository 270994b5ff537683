"""The text of the kind node image's own files (hack/kind_node.py puts them in): the entrypoint that prepares the
container for systemd, the kubelet's units, the CNI and storage manifests kind applies, and the node's Dockerfile.
containerd's config is hack/common.py's."""

ENTRYPOINT = r'''#!/bin/bash
# Prepares this container for systemd and the kubelet, then execs the command (/sbin/init).
set -o errexit -o nounset -o pipefail
info() { echo "INFO: $*" >&2; }

# systemd in a container expects a read-only /sys (udev and friends then skip themselves); / is rshared
# so that mounts the kubelet makes for volumes propagate into the pods that use them.
mount -o remount,ro /sys
mount --make-rshared /

# cgroups. v2: the kubelet unit's drop-in delegates controllers once systemd runs. v1: needs a private
# cgroup namespace (kind passes --cgroupns=private), so every hierarchy's root is this container's; the
# kubelet's roots (/kubelet, and /kubelet.slice with the systemd driver) are made bind mounts of
# themselves, as the kubelet and cAdvisor find cgroup roots through /proc/self/mountinfo.
if [[ ! -f /sys/fs/cgroup/cgroup.controllers ]]; then
  if [[ $(grep -E '^[0-9]+:([^:]*,)?cpu(,[^:]*)?:' /proc/self/cgroup | cut -d: -f3) != / ]]; then
    echo "ERROR: cgroup v1 without a private cgroup namespace (docker run --cgroupns=private)" >&2
    exit 1
  fi
  if [[ -d /sys/fs/cgroup/misc ]]; then
    # the kubelet's cgroup v1 code knows no misc controller and fails on it
    umount /sys/fs/cgroup/misc && rmdir /sys/fs/cgroup/misc
    grep -v '^misc' /proc/cgroups >/kind/cgroups && mount --bind /kind/cgroups /proc/cgroups
  fi
  mount --make-rprivate /sys/fs/cgroup
  for hierarchy in $(findmnt -lun -o target -t cgroup); do
    for root in kubelet kubelet.slice; do
      mkdir -p "$hierarchy/$root"
      if [[ $hierarchy == */cpuset ]]; then
        cat "$hierarchy/cpuset.cpus" >"$hierarchy/$root/cpuset.cpus"
        cat "$hierarchy/cpuset.mems" >"$hierarchy/$root/cpuset.mems"
      fi
      mount --bind "$hierarchy/$root" "$hierarchy/$root"
    done
  done
fi

# every node its own identity
rm -f /etc/machine-id && systemd-machine-id-setup >/dev/null
[[ -f /kind/product_uuid ]] || cat /proc/sys/kernel/random/uuid >/kind/product_uuid
for f in /sys/class/dmi/id/product_uuid /sys/devices/virtual/dmi/id/product_uuid; do
  [[ -f $f ]] && mount -o ro,bind /kind/product_uuid "$f"
done

sysctl -q -w net.ipv4.ip_forward=1 net.ipv4.conf.all.route_localnet=1

# Without CAP_SYS_RESOURCE in the bounding set (some sandboxed hosts), no process here may lower an
# oom_score_adj, and runc fails every pod sandbox the kubelet gives -998 ("can't get final child's PID
# from pipe"); containerd then keeps each container's score at least at its own.
if (( (0x$(awk '/^CapBnd:/ {print $2}' /proc/self/status) >> 24 & 1) == 0 )); then
  info "no CAP_SYS_RESOURCE: containerd restricts oom_score_adj"
  sed -i 's/restrict_oom_score_adj = false/restrict_oom_score_adj = true/' /etc/containerd/config.toml
fi

# Docker's embedded DNS answers on 127.0.0.11 in this network namespace only, through DNAT rules Docker
# put in OUTPUT. Pods (and CoreDNS forwarding upstream) use the gateway address instead: the same rules
# are applied to PREROUTING for it, and resolv.conf names it.
gateway=$(ip -4 route show default | awk '{print $3; exit}')
if [[ -n $gateway ]] && grep -q '^nameserver 127.0.0.11' /etc/resolv.conf; then
  iptables-save -t nat \
    | sed -e "s/-d 127.0.0.11/-d $gateway/g" \
          -e 's/^-A OUTPUT \(.*\) -j DOCKER_OUTPUT$/&\n-A PREROUTING \1 -j DOCKER_OUTPUT/' \
          -e "s/--to-source :53/--to-source $gateway:53/g" \
    | iptables-restore
  sed -e "s/127.0.0.11/$gateway/" /etc/resolv.conf >/etc/resolv.conf.new
  cat /etc/resolv.conf.new >/etc/resolv.conf && rm /etc/resolv.conf.new
fi

# After `docker start` the node may have a new address: rewrite the files that name the old one (the
# node's kubelet flags, and on a control plane its manifests and kubeconfigs) and reissue the API
# server's certificate, whose SANs carry it.
ipv4=$(getent ahostsv4 "$(hostname)" | awk '{print $1; exit}')
if [[ -n $ipv4 && -f /kind/old-ipv4 && $(cat /kind/old-ipv4) != "$ipv4" ]]; then
  old=$(cat /kind/old-ipv4)
  info "address changed from $old to $ipv4"
  for f in /etc/kubernetes/manifests/*.yaml /etc/kubernetes/*.conf /kind/kubeadm.conf \
           /var/lib/kubelet/kubeadm-flags.env; do
    [[ -f $f ]] && sed -i "s#\b${old//./\\.}\b#$ipv4#g" "$f"
  done
  if [[ -f /etc/kubernetes/pki/apiserver.crt ]]; then
    rm -f /etc/kubernetes/pki/apiserver.crt /etc/kubernetes/pki/apiserver.key
    kubeadm init phase certs apiserver --config /kind/kubeadm.conf
  fi
fi
[[ -z $ipv4 ]] || echo -n "$ipv4" >/kind/old-ipv4

info "starting $*"
exec "$@"
'''

KUBELET_SERVICE = '''\
[Unit]
Description=kubelet: The Kubernetes Node Agent
# kubeadm writes the config on init/join; until then the unit waits
ConditionPathExists=/var/lib/kubelet/config.yaml
After=containerd.service

[Service]
ExecStart=/usr/bin/kubelet
Restart=always
StartLimitInterval=0
RestartSec=1s
CPUAccounting=true
MemoryAccounting=true
Slice=kubelet.slice
KillMode=process

[Install]
WantedBy=multi-user.target
'''

# the flags kubeadm expects its kubelet unit to pass (kubeadm's packaging drop-in)
KUBEADM_DROPIN = '''\
[Service]
Environment="KUBELET_KUBECONFIG_ARGS=--bootstrap-kubeconfig=/etc/kubernetes/bootstrap-kubelet.conf --kubeconfig=/etc/kubernetes/kubelet.conf"
Environment="KUBELET_CONFIG_ARGS=--config=/var/lib/kubelet/config.yaml"
EnvironmentFile=-/var/lib/kubelet/kubeadm-flags.env
EnvironmentFile=-/etc/default/kubelet
ExecStart=
ExecStart=/usr/bin/kubelet $KUBELET_KUBECONFIG_ARGS $KUBELET_CONFIG_ARGS $KUBELET_KUBEADM_ARGS $KUBELET_EXTRA_ARGS
'''

# kind's kubelet config sets cgroupRoot /kubelet; v2 needs its controllers enabled down to it
CGROUP_DROPIN = '''\
[Service]
ExecStartPre=/bin/sh -euc 'if [ -f /sys/fs/cgroup/cgroup.controllers ]; then for g in "" /kubelet /kubelet.slice; do mkdir -p /sys/fs/cgroup$g; sed -e "s/ / +/g" -e "s/^/+/" </sys/fs/cgroup$g/cgroup.controllers >/sys/fs/cgroup$g/cgroup.subtree_control; done; elif [ ! -d /sys/fs/cgroup/systemd/kubelet ]; then mkdir -p /sys/fs/cgroup/systemd/kubelet; fi'
'''

KUBELET_SLICE = '''\
[Unit]
Description=slice of the kubelet and its pods
Before=slices.target

[Slice]
MemoryAccounting=true
CPUAccounting=true
'''

CNI_MANIFEST = '''\
# kube-router: routes between the nodes (iBGP full mesh over the kind network), the bridge CNI plugin on
# each node (kube-router writes the node's pod CIDR, allocated by the controller manager, into the config)
# and NetworkPolicy enforcement. Services stay with kube-proxy.
apiVersion: v1
kind: ServiceAccount
metadata: {name: kube-router, namespace: kube-system}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: kube-router}
rules:
- apiGroups: [""]
  resources: [namespaces, pods, services, nodes, endpoints]
  verbs: [get, list, watch]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [get, list, watch]
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  verbs: [get, create, update]
- apiGroups: [""]
  resources: [services/status]
  verbs: [update]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: kube-router}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: kube-router}
subjects: [{kind: ServiceAccount, name: kube-router, namespace: kube-system}]
---
apiVersion: v1
kind: ConfigMap
metadata: {name: kube-router-cni, namespace: kube-system}
data:
  10-kuberouter.conflist: |
    {"cniVersion": "0.3.1", "name": "kubernetes", "plugins": [
      {"type": "bridge", "bridge": "kube-bridge", "isDefaultGateway": true, "hairpinMode": true,
       "ipam": {"type": "host-local"}},
      {"type": "portmap", "capabilities": {"portMappings": true}, "snat": true}]}
---
apiVersion: apps/v1
kind: DaemonSet
metadata: {name: kube-router, namespace: kube-system, labels: {k8s-app: kube-router}}
spec:
  selector: {matchLabels: {k8s-app: kube-router}}
  template:
    metadata: {labels: {k8s-app: kube-router}}
    spec:
      serviceAccountName: kube-router
      priorityClassName: system-node-critical
      hostNetwork: true
      tolerations: [{operator: Exists}]
      initContainers:
      - name: install-cni
        image: {image}
        command: [/bin/sh, -c, "cp /cni/10-kuberouter.conflist /etc/cni/net.d/.tmp && mv /etc/cni/net.d/.tmp /etc/cni/net.d/10-kuberouter.conflist"]
        volumeMounts:
        - {name: cni-conf, mountPath: /etc/cni/net.d}
        - {name: cni-template, mountPath: /cni}
      containers:
      - name: kube-router
        image: {image}
        args:
        - --run-router=true
        - --run-firewall=true
        - --run-service-proxy=false
        - --bgp-graceful-restart=true
        env:
        - name: NODE_NAME
          valueFrom: {fieldRef: {fieldPath: spec.nodeName}}
        - name: POD_NAME
          valueFrom: {fieldRef: {fieldPath: metadata.name}}
        - {name: KUBE_ROUTER_CNI_CONF_FILE, value: /etc/cni/net.d/10-kuberouter.conflist}
        livenessProbe:
          httpGet: {path: /healthz, port: 20244}
          initialDelaySeconds: 10
          periodSeconds: 3
        resources: {requests: {cpu: 50m, memory: 64Mi}}
        securityContext: {privileged: true}
        volumeMounts:
        - {name: lib-modules, mountPath: /lib/modules, readOnly: true}
        - {name: cni-conf, mountPath: /etc/cni/net.d}
        - {name: xtables-lock, mountPath: /run/xtables.lock}
      volumes:
      - {name: lib-modules, hostPath: {path: /lib/modules}}
      - {name: cni-conf, hostPath: {path: /etc/cni/net.d}}
      - {name: cni-template, configMap: {name: kube-router-cni}}
      - {name: xtables-lock, hostPath: {path: /run/xtables.lock, type: FileOrCreate}}
'''

STORAGE_MANIFEST = '''\
# The controller manager's host-path provisioner (kind enables it): a volume is a directory on a node,
# not shared between nodes. Enough for tests; there is no local-path provisioner image offline.
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata:
  name: standard
  annotations: {storageclass.kubernetes.io/is-default-class: "true"}
provisioner: kubernetes.io/host-path
'''

NODE_DOCKERFILE = '''\
FROM {base}
COPY files/ /
RUN chmod 755 /kind /usr/local/bin/entrypoint \\
 && mkdir -p /opt/cni && ln -sfn /usr/lib/cni /opt/cni/bin \\
 && mkdir -p /etc/kubernetes/manifests /etc/cni/net.d /var/lib/kubelet \\
 && echo "ReadKMsg=no" >>/etc/systemd/journald.conf \\
 && rm -f /etc/systemd/system/*.wants/* /lib/systemd/system/multi-user.target.wants/getty.target \\
 && systemctl enable containerd.service kubelet.service \\
 && systemctl mask systemd-binfmt.service getty.target console-getty.service systemd-udevd.service \\
      systemd-modules-load.service sys-kernel-debug.mount sys-kernel-tracing.mount
ENV container=docker
STOPSIGNAL SIGRTMIN+3
ENTRYPOINT ["/usr/local/bin/entrypoint", "/sbin/init"]
'''
