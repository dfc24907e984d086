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
