{{/* Names, labels and the few derived settings every template shares. */}}

{{- define "ddp-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release name, plus the chart name unless the release name already contains it. */}}
{{- define "ddp-operator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "ddp-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "ddp-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ddp-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "ddp-operator.labels" -}}
helm.sh/chart: {{ include "ddp-operator.chart" . }}
{{ include "ddp-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: ddpjob
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "ddp-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "ddp-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The operator's image: repository:tag, plus @digest when image.digest is set (then the digest decides). */}}
{{- define "ddp-operator.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag }}
{{- printf "%s:%s" .Values.image.repository $tag }}{{ with .Values.image.digest }}@{{ . }}{{ end }}
{{- end }}

{{/* The rendezvous-store pods' image (storeImage): repository:tag, plus @digest when storeImage.digest is set. */}}
{{- define "ddp-operator.storeImage" -}}
{{- $tag := default .Chart.AppVersion .Values.storeImage.tag }}
{{- printf "%s:%s" .Values.storeImage.repository $tag }}{{ with .Values.storeImage.digest }}@{{ . }}{{ end }}
{{- end }}

{{/* The install notes' sample job's trainer image (sampleImage): repository:tag, plus @digest when set. */}}
{{- define "ddp-operator.sampleImage" -}}
{{- $tag := default .Chart.AppVersion .Values.sampleImage.tag }}
{{- printf "%s:%s" .Values.sampleImage.repository $tag }}{{ with .Values.sampleImage.digest }}@{{ . }}{{ end }}
{{- end }}

{{/* The diagnostics sidecar's tools image: the operator's own (its digest too) unless diagnostics.image says
otherwise. */}}
{{- define "ddp-operator.diagnosticsImage" -}}
{{- $d := .Values.diagnostics.image }}
{{- $repository := default .Values.image.repository $d.repository }}
{{- $tag := default (default .Chart.AppVersion .Values.image.tag) $d.tag }}
{{- $digest := $d.digest }}
{{- if and (not $digest) (not $d.repository) (not $d.tag) }}{{ $digest = .Values.image.digest }}{{ end }}
{{- printf "%s:%s" $repository $tag }}{{ with $digest }}@{{ . }}{{ end }}
{{- end }}

{{/* "true" when leader election is on: explicitly, or automatically with more than one replica. */}}
{{- define "ddp-operator.leaderElection" -}}
{{- $mode := .Values.operator.leaderElection.mode }}
{{- if or (eq $mode "on") (and (eq $mode "auto") (gt (int .Values.replicaCount) 1)) }}true{{ end }}
{{- end }}

{{/*
The namespaces that get a Role in namespace scope. Fails early, with the fix, on a combination that
would install an operator unable to see anything.
*/}}
{{- define "ddp-operator.validate" -}}
{{- if and (eq .Values.rbac.scope "namespace") (not .Values.watch.namespaces) }}
{{- fail "rbac.scope=namespace needs watch.namespaces (e.g. --set 'watch.namespaces={team-a}'); leave rbac.scope=cluster to watch every namespace" }}
{{- end }}
{{- if and .Values.watch.exclude .Values.watch.namespaces }}
{{- fail "watch.exclude applies when watching every namespace: leave watch.namespaces empty, or list only the namespaces to watch there" }}
{{- end }}
{{- if eq .Values.image.tag "latest" }}
{{- fail "image.tag=latest is refused: pin a version (leave it empty for the chart's appVersion)" }}
{{- end }}
{{- if eq .Values.storeImage.tag "latest" }}
{{- fail "storeImage.tag=latest is refused: pin a version (leave it empty for the chart's appVersion)" }}
{{- end }}
{{- if eq .Values.diagnostics.image.tag "latest" }}
{{- fail "diagnostics.image.tag=latest is refused: pin a version (leave it empty for the operator's)" }}
{{- end }}
{{- if and (gt (int .Values.replicaCount) 1) (eq .Values.operator.leaderElection.mode "off") }}
{{- fail "replicaCount > 1 needs leader election (operator.leaderElection.mode auto or on): two active operators would both act on every DDPJob" }}
{{- end }}
{{- end }}

{{/*
Rules the operator needs in every namespace it watches; the cluster scope adds Nodes and CRDs.
Least privilege, from what the operator calls (operator/ddp_operator/k8s.py) and what kopf needs to
watch and annotate the objects it handles: no secrets, no configmaps, no pods/exec, no updates.
*/}}
{{- define "ddp-operator.namespacedRules" -}}
# kopf watches DDPJobs and records handler state in annotations (patch); TTL deletes finished jobs;
# the operator merge-patches status.
- apiGroups: [ddp.dev]
  resources: [ddpjobs]
  verbs: [list, watch, patch, delete]
- apiGroups: [ddp.dev]
  resources: [ddpjobs/status]
  verbs: [patch]
# Owner references with blockOwnerDeletion need this where OwnerReferencesPermissionEnforcement is on.
- apiGroups: [ddp.dev]
  resources: [ddpjobs/finalizers]
  verbs: [update]
# Children: created with owner references, so garbage collection removes them with the job. Reads come from
# kopf's watches (list, watch); get only to see who owns an object that holds a child's name (409); patch only
# for the pod annotation that tells a job with spares its size; tests/rbac_needs.py derives every verb from the code.
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, create]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
# Each job's metric history (<job>-history, owned by the job), read and replaced as the job reports progress.
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, create, update]
# Each job's NetworkPolicy (owned by the job); patched back when its rules drift (an edit, another operator
# identity); deleted when spec.networkPolicy.enabled turns false.
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [list, watch, create, patch, delete]
{{- end }}

{{/* The Kueue integration (kueue.enabled): the job's Workload, owned by the job; Kueue's status conditions are
written back on eviction and when the job finishes. */}}
{{- define "ddp-operator.kueueRules" -}}
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads/status]
  verbs: [patch]
{{- end }}

{{/* Kueue's cluster-scoped objects the operator reads: an admission's flavors, a job's priority class. */}}
{{- define "ddp-operator.kueueClusterRules" -}}
- apiGroups: [kueue.x-k8s.io]
  resources: [resourceflavors, workloadpriorityclasses]
  verbs: [get]
{{- end }}

{{/* The Lease of leader election, in the release namespace. */}}
{{- define "ddp-operator.leaseRules" -}}
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  verbs: [create]
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  resourceNames: [{{ .Values.operator.leaderElection.leaseName }}]
  verbs: [get, update]
{{- end }}

{{/*
watch.exclude as one kopf namespace pattern ("!a,!b-*": every namespace but those), and as one RE2 expression
for the admission policy's CEL ("^(a|b-.*)$"); namespace names have no other character special to either.
*/}}
{{- define "ddp-operator.excludePattern" -}}
{{- $parts := list }}
{{- range .Values.watch.exclude }}{{ $parts = append $parts (printf "!%s" .) }}{{ end }}
{{- join "," $parts }}
{{- end }}

{{- define "ddp-operator.excludeRegex" -}}
{{- $parts := list }}
{{- range .Values.watch.exclude }}{{ $parts = append $parts (. | replace "*" ".*" | replace "?" ".") }}{{ end }}
{{- printf "^(%s)$" (join "|" $parts) }}
{{- end }}
