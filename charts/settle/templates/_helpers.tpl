{{- define "settle.name" -}}settle{{- end -}}
{{- define "settle.fullname" -}}{{ .Release.Name | trunc 50 | trimSuffix "-" }}{{- end -}}
{{- define "settle.labels" -}}
app.kubernetes.io/name: settle
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end -}}
{{- define "settle.selector" -}}
app.kubernetes.io/name: settle
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}
{{- define "settle.webhookService" -}}{{ include "settle.fullname" . }}-webhook{{- end -}}
{{- define "settle.leaseName" -}}{{ .Values.leaderElection.leaseName | default (printf "%s-operator" (include "settle.fullname" .)) }}{{- end -}}
{{- define "settle.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end -}}
{{- /* The kube-score checks declined by the values in force, with their reasons in values.yaml. */ -}}
{{- define "settle.kubeScoreIgnore" -}}
{{- $ignore := list -}}
{{- if ne .Values.image.pullPolicy "Always" -}}{{- $ignore = append $ignore "container-image-pull-policy" -}}{{- end -}}
{{- if not .Values.networkPolicy.enabled -}}{{- $ignore = append $ignore "pod-networkpolicy" -}}{{- end -}}
{{- join "," $ignore -}}
{{- end -}}
